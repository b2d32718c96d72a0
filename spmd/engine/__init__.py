"""The rule engine: sharding rules decide (`rules/`, over the values in `decision.py`), the planner turns layout
changes into collectives (`planner.py`), and the dispatcher (`dispatch.py`) executes decisions on the stacked
components of DTensors. Only the dispatcher and the planner run collectives."""
