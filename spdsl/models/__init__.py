"""Example models as plain single-device PyTorch (Llama 3.x in ``llama``, toy families in
``toys``). They import only torch (and einops) and know nothing of spdsl; the rest of spdsl never
imports them."""
