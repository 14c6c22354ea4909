"""The sections of ``bench/gpu_check.sh``: each runs in its own process and writes one JSON file
under ``bench/results/gpu/``; ``summarize`` gathers them into ``gpu_check.json`` and
``summary.md``."""
