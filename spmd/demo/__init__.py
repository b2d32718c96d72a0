"""`spmd demo`: train a small GPT on a bundled corpus with data and tensor (Megatron) parallelism."""
