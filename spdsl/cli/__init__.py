"""The command lines (``python -m spdsl plan | memory``) and the planner's search over model
shapes: the layer above ``spdsl.annotate`` that wraps models it builds itself."""
