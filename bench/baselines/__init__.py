"""Building blocks of ``bench/compare.py``: one module per idea.

- ``model``    the benchmarked model and its loss on pre-shifted labels
- ``data``     seeded batches, labels shifted outside the model
- ``systems``  the registry of systems; one module each: ``reference``, ``ulysses``,
               ``autosp``, ``spdsl_adapter``
- ``measure``  collective bytes and peak tensor memory, read from one profiled step
- ``analytic`` the Ulysses communication floor
- ``runner``   the per-rank loop: warm-up, timed steps, profiled step, parity
- ``report``   markdown tables and the sweep plot
- ``suite``    launches every torchrun configuration and writes the results
"""
