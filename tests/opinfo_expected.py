"""The reviewed expectations of the OpInfo sweep (`tests/test_opinfo.py`), keyed by OpInfo id (`name.variant`).

UNSUPPORTED is exact in both directions: a listed phase that starts to work fails the test until its entry goes,
as does an unlisted one that raises. KNOWN_BUGS are strict xfails: a fix fails the test until its entry goes.
`python tests/test_opinfo.py` prints which entries are out of date.
"""

# -- ops not swept --------------------------------------------------------------------------------------------------
# Their values are random or uninitialised, so no two runs agree, or their tensors are sparse. (spmd's own random
# ops are layout-invariant but draw other numbers than torch's generator: tests/test_ops_sweep.py checks them.)
_RANDOM = ["bernoulli", "cauchy", "exponential", "geometric", "log_normal", "multinomial", "normal",
           "normal.in_place", "normal.number_mean", "uniform", "rand_like", "randn_like", "randint_like", "randn",
           "randint", "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d",
           "nn.functional.alpha_dropout", "nn.functional.feature_alpha_dropout.with_train", "nn.functional.rrelu",
           "nn.functional.fractional_max_pool2d", "nn.functional.fractional_max_pool3d", "svd_lowrank",
           "pca_lowrank",
           "nn.functional.multi_head_attention_forward"]  # its samples train with dropout_p=0.5
_UNINITIALISED = ["empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"]
_SPARSE = ["sparse.sampled_addmm", "sparse.mm.reduce", "to_sparse"]
SKIPPED = ({name: "random values" for name in _RANDOM}
           | {name: "uninitialised memory" for name in _UNINITIALISED}
           | {name: "sparse tensors" for name in _SPARSE})

# -- spmd raises UnsupportedOpError or MixedTensorError (op -> phases) ----------------------------------------------
_FORWARD, _BACKWARD, _BOTH = ("forward",), ("backward",), ("forward", "backward")
UNSUPPORTED = {
    # no rule, no meta kernel, and a list of tensors as its result (the replicated fallback takes plain tensors)
    "histogramdd": _FORWARD,
}

# -- known bugs: a wrong answer or another exception (strict xfails) ----------------------------------------------
KNOWN_BUGS: dict[str, str] = {}

# -- the default run: ops across the families -------------------------------------------------------------------------
DEFAULT_OPS = [
    # elementwise
    "abs", "exp", "sin", "tanh", "sigmoid", "nan_to_num", "clamp", "add", "mul", "div.no_rounding_mode", "pow",
    "maximum", "atan2", "where", "lerp", "addcmul", "masked_fill", "copysign", "sgn",
    # reductions and scans
    "sum", "mean", "var", "std", "amax", "argmax", "prod", "logsumexp", "norm", "max.reduction_with_dim", "topk",
    "sort", "cumsum",
    # views, reshapes, joins
    "reshape", "view", "permute", "transpose", "expand", "squeeze", "unsqueeze", "flatten", "narrow", "select",
    "chunk", "split", "cat", "stack", "flip", "roll", "repeat", "diagonal", "tril", "triu",
    # indexing
    "gather", "scatter", "index_select", "index_add", "take_along_dim", "__getitem__", "nonzero", "masked_select",
    "unique",
    # contractions and linalg
    "mm", "bmm", "matmul", "einsum", "addmm", "linalg.vector_norm", "linalg.svd", "linalg.det", "linalg.inv",
    "linalg.qr",
    # nn.functional
    "nn.functional.linear", "nn.functional.conv2d", "nn.functional.layer_norm", "softmax", "log_softmax",
    "nn.functional.gelu", "nn.functional.silu", "nn.functional.embedding", "nn.functional.cross_entropy",
    "nn.functional.mse_loss", "nn.functional.max_pool2d", "nn.functional.avg_pool2d",
    "nn.functional.interpolate.bilinear", "nn.functional.pad.constant", "nn.functional.group_norm",
    "nn.functional.scaled_dot_product_attention",
    # fft, conversions
    "fft.fft", "fft.rfft", "fft.irfft", "fft.hfft2", "fft.fftshift", "float",
]
