"""The Hugging Face side of the benchmark: a tiny random ``LlamaForCausalLM`` and the two systems
an HF user starts from: the single-process model, and spdsl on the unmodified model.

The HF config mirrors ``spdsl.models.llama.LlamaConfig.tiny()`` (or ``small()``): same widths, heads,
kv heads, depth, vocabulary, norm epsilon and RoPE base; SDPA attention, dropout off, fp32,
built from the config (no download) with the same seed in every process and for every system.

Labels follow the HF convention: ``labels = input_ids`` (``-100`` where ignored), shifted inside
the model's loss (``logits[:, :-1]`` against ``labels[:, 1:]``). spdsl receives exactly that;
ALST (``alst_hf.py``) shifts them in its data adapter before sharding, as it prescribes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .model import CONFIGS
from .reference import LossTrainer
from .systems import RunConfig, Unavailable

if TYPE_CHECKING:
    import spdsl


# the MoE variant (``--moe``): Mixtral's router and experts in place of the MLP
EXPERTS, TOP_K = 4, 2


def hf_config(name: str, family: str = "llama"):
    """The transformers ``LlamaConfig`` with the shape of ``CONFIGS[name]()``; ``mixtral``:
    a ``MixtralConfig`` of the same widths whose MLP is ``EXPERTS`` experts of that width, each
    token routed to ``TOP_K``, with the router's load-balancing loss in the loss."""
    try:
        import transformers
    except ImportError as e:
        raise Unavailable(f"transformers is not installed ({e}); pip install the hf extra")
    c = CONFIGS[name]()
    if family == "mixtral":
        cfg = transformers.MixtralConfig(
            vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
            num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
            num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
            rope_theta=c.rope_theta, max_position_embeddings=c.max_seq_len,
            tie_word_embeddings=c.tie_embeddings, attention_dropout=0.0,
            num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, output_router_logits=True,
            router_jitter_noise=0.0)
        cfg._attn_implementation = "sdpa"
        return cfg
    cfg = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim,
        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads,
        num_key_value_heads=c.n_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.norm_eps,
        rope_theta=c.rope_theta, max_position_embeddings=c.max_seq_len,
        tie_word_embeddings=c.tie_embeddings, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return cfg


def build_hf_llama(name: str, seed: int, family: str = "llama") -> torch.nn.Module:
    """The same initial weights in every process and for every system."""
    import transformers

    cfg = hf_config(name, family)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM if family == "mixtral" else \
        transformers.LlamaForCausalLM
    return model(cfg).float().train()


def hf_loss(model: torch.nn.Module):
    """``(input_ids, labels) -> loss`` of an HF causal LM, its own shift and mean."""
    def loss_fn(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids, labels=labels, use_cache=False).loss
    return loss_fn


class HFReferenceTrainer(LossTrainer):
    """The whole batch in one process (rank 0), the model as an HF user runs it."""

    def __init__(self, cfg: RunConfig) -> None:
        # the parameters compared
        self.llama = build_hf_llama(cfg.model, cfg.seed, cfg.hf_family)
        self.fn = hf_loss(self.llama)
        self.opt = torch.optim.AdamW(self.llama.parameters(), lr=cfg.lr)


class SpdslHFTrainer(HFReferenceTrainer):
    """``spdsl.sp_shard(seq=P)`` over the unmodified HF model's loss; global tensors in."""

    def __init__(self, cfg: RunConfig, compiled: bool,
                 remat: str | spdsl.Remat | None = None) -> None:
        import spdsl

        super().__init__(cfg)
        kwargs = {"compile": True} if compiled else {}
        if remat is not None:
            kwargs["remat"] = remat
        self.fn = spdsl.sp_shard(seq=cfg.world, **kwargs)(hf_loss(self.llama))


def build_reference(cfg: RunConfig, compiled: bool) -> HFReferenceTrainer:
    if compiled:
        raise Unavailable("the HF reference is eager PyTorch")
    return HFReferenceTrainer(cfg)


def build_spdsl(cfg: RunConfig, compiled: bool) -> SpdslHFTrainer:
    return SpdslHFTrainer(cfg, compiled)


def build_spdsl_full(cfg: RunConfig, compiled: bool) -> SpdslHFTrainer:
    """``remat="full"`` with the all-to-alls re-run in backward: each layer keeps its input
    only, as HF's gradient checkpointing does (``alst-checkpoint``)."""
    import spdsl
    return SpdslHFTrainer(cfg, compiled, remat=spdsl.Remat("full", recompute_collectives=True))
