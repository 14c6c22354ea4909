"""Reading a ``ShardingPlan``: the text table, JSON, HTML, ``explain`` and the CLI.

The plan itself (``spdsl.propagate.plan``) only collects facts; everything here presents them.
"""
