"""Reading a ``ShardingPlan``: the text table, JSON, HTML, ``explain`` and the CLI.

The plan (``spdsl.inspect.plan``) collects the facts from propagation's decision record; the
other modules present them. Nothing below ``spdsl.inspect`` imports it.
"""
