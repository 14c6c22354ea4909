"""Hugging Face mixture-of-experts causal LMs under ``sp_shard``: tiny random configs, the
cases the parity tests run on every rank of one launch, and what each case measures.

Every family is built with ``output_router_logits=True`` and a large ``router_aux_loss_coef``,
so the load-balancing loss (means over every token of the batch) is a visible part of
``.loss``. A case returns the errors of the loss, of the load-balancing loss alone and of every
parameter gradient against single-device PyTorch, plus the error the load-balancing loss would
have if its statistics were taken from the rank's own tokens only (``aux_local``): that one
must be large, or the test could not tell the two apart.
"""

from __future__ import annotations

import copy
import traceback
from dataclasses import dataclass

import torch

import spdsl
from tests.hf.cases import grad_errors
from tests.hf.families import VOCAB, batch, padded

EXPERTS_IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")

_BASE = {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "attention_dropout": 0.0, "output_router_logits": True, "router_aux_loss_coef": 0.5}

# family -> (config class, model class, config keyword arguments)
MOE_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {**_BASE, "intermediate_size": 32, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  {**_BASE, "intermediate_size": 64, "moe_intermediate_size": 32,
                   "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                   "decoder_sparse_step": 1, "norm_topk_prob": True}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  {**_BASE, "intermediate_size": 64, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 32, "num_experts": 4,
                   "num_experts_per_tok": 2, "decoder_sparse_step": 1}),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              {**_BASE, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
               "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2}),
    # group-limited routing (a scatter_ into a group mask per token), a shared expert, a dense
    # first layer; no load-balancing loss
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    {**_BASE, "intermediate_size": 64, "moe_intermediate_size": 32,
                     "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1,
                     "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                     "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 16, "rope_scaling": None}),
    # attention sinks (eager attention only), biased experts, sliding and full layers
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM",
                {**_BASE, "intermediate_size": 32, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "head_dim": 16, "sliding_window": 8,
                 "layer_types": ["sliding_attention", "full_attention"]}),
    # hybrids: experts in every layer, a linear-attention or state-space mixer in the first
    # (run gathered on every rank: no sequence-parallel rule for those mixers yet), attention
    # in the second. Gated DeltaNet, a shared expert behind a sigmoid gate
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {**_BASE, "intermediate_size": 64, "moe_intermediate_size": 32,
                    "shared_expert_intermediate_size": 32, "head_dim": 16, "num_experts": 4,
                    "num_experts_per_tok": 2, "decoder_sparse_step": 1,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                    "layer_types": ["linear_attention", "full_attention"]}),
    # Kimi delta attention, then multi-head latent attention; sigmoid routing with a bias, a
    # shared expert; no load-balancing loss
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    {**_BASE, "num_key_value_heads": 4, "intermediate_size": 64,
                     "moe_intermediate_size": 32, "num_local_experts": 4,
                     "num_experts_per_tok": 2, "n_shared_experts": 1, "kv_lora_rank": 16,
                     "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                     "v_head_dim": 16, "linear_head_dim": 16, "linear_num_heads": 4,
                     "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                     "layer_types": ["linear_attention", "full_attention"],
                     "mlp_layer_types": ["sparse", "sparse"]}),
    # lightning attention in blocks of 8 tokens, then softmax attention
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM",
                {**_BASE, "intermediate_size": 32, "head_dim": 16, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "block_size": 8,
                 "layer_types": ["linear_attention", "full_attention"]}),
    # Mamba-1 (selective scan), then attention; the experts under feed_forward
    "jamba": ("JambaConfig", "JambaForCausalLM",
              {**_BASE, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
               "expert_layer_period": 1, "expert_layer_offset": 0, "attn_layer_period": 2,
               "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
               "mamba_expand": 2, "mamba_dt_rank": 8}),
    # Granite 4 hybrid: Mamba-2 (SSD, chunks of 8), then attention; a shared MLP
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         {**_BASE, "intermediate_size": 32, "num_local_experts": 4,
                          "num_experts_per_tok": 2, "shared_intermediate_size": 32,
                          "layer_types": ["mamba", "attention"], "mamba_n_heads": 8,
                          "mamba_n_groups": 1, "mamba_d_state": 8, "mamba_d_head": 16,
                          "mamba_chunk_size": 8, "position_embedding_type": "rope"}),
    # DeepSeek-V3.2: DeepSeek-V3's routing and latent attention with a lightning indexer that
    # keeps each query's top 8 keys; a dense first layer; no load-balancing loss
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM",
                     {**_BASE, "num_key_value_heads": 4, "intermediate_size": 64,
                      "moe_intermediate_size": 32, "n_routed_experts": 4,
                      "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2,
                      "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 16,
                      "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                      "v_head_dim": 16, "head_dim": 8, "index_topk": 8,
                      "index_head_dim": 16, "index_n_heads": 2}),
}
ATTN = {"gpt_oss": "eager"}       # no SDPA path in transformers
# layers with experts (DeepSeek-V3's first is dense), and the module holding them
MOE_LAYERS = {"deepseek_v3": (1,), "deepseek_v32": (1,)}
BIAS_BALANCED = ("deepseek_v3", "kimi_linear", "deepseek_v32")   # no load-balancing loss
MOE_BLOCK = {"jamba": "feed_forward", "granitemoehybrid": "block_sparse_moe"}
ROUTERS = ("mlp.gate.weight", "mlp.router.weight", "feed_forward.router.weight",
           "block_sparse_moe.router.weight")


def experts_modules(family: str, layers: int) -> list[str]:
    """The names of ``family``'s experts modules, one per MoE layer."""
    block = MOE_BLOCK.get(family, "mlp")
    return [f"model.layers.{i}.{block}.experts" for i in MOE_LAYERS.get(family, range(layers))]


def records_router_logits(family: str) -> bool:
    """Whether this transformers' ``family`` returns router logits: Granite 4 hybrid's
    recorder for them is missing in 5.17 (``output_router_logits=True`` raises there, on a
    single device too), present in 5.23."""
    import transformers
    recorders = getattr(transformers, MOE_FAMILIES[family][1])._can_record_outputs or {}
    return "router_logits" in recorders


def build_moe(family: str, experts: str = "eager", seed: int = 0) -> torch.nn.Module:
    """The tiny random model of ``family`` with ``config._experts_implementation=experts``."""
    import transformers
    cfg_name, model_name, kwargs = MOE_FAMILIES[family]
    if not records_router_logits(family):
        kwargs = {**kwargs, "output_router_logits": False}
    cfg = getattr(transformers, cfg_name)(**kwargs)
    cfg._attn_implementation = ATTN.get(family, "sdpa")
    cfg._experts_implementation = experts
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).float().train()
    with torch.no_grad():     # a decisive router: each piece of the sequence routes its own way
        for name, p in model.named_parameters():
            if name.endswith(ROUTERS):
                p.mul_(ROUTER_SCALE)
    return model


ROUTER_SCALE = 20.0


@dataclass(frozen=True)
class MoeCase:
    family: str
    experts: str = "eager"
    remat: str | None = None
    data: str = "plain"             # plain | pad_right
    compile: bool = False
    shard_state: bool = False

    @property
    def name(self) -> str:
        return f"{self.family}/{self.experts}/{self.data}" + (
            f",remat={self.remat}" if self.remat else "") + (",compiled" if self.compile else "") + (
            ",shard_state" if self.shard_state else "")


def _inputs(data: str):
    if data == "plain":
        ids, labels = batch()
        return ids, labels, None
    return padded(side="right")


def _outputs(model, ids, labels, mask):
    out = model(input_ids=ids, labels=labels, attention_mask=mask, use_cache=False)
    aux = getattr(out, "aux_loss", None)
    return out.loss, (out.loss * 0 if aux is None else aux)    # (DeepSeek-V3 has none)


def aux_from(model, logits: tuple[torch.Tensor, ...], mask=None) -> torch.Tensor:
    """Hugging Face's load-balancing loss of ``model`` from router logits."""
    import importlib
    mod = importlib.import_module(type(model).__module__)
    cfg = model.config
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    return mod.load_balancing_loss_func(logits, experts, cfg.num_experts_per_tok, mask)


def local_aux_error(model, ids, mask, rank: int, world: int) -> float:
    """Relative error of the load-balancing loss computed from the rank's own piece of the
    sequence only (a mean of local statistics) against the global one."""
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, use_cache=False,
                    output_router_logits=True)
        full = aux_from(model, out.router_logits, mask)
        b, s = ids.shape
        lo, hi = rank * s // world, (rank + 1) * s // world
        piece = tuple(g.reshape(b, s, -1)[:, lo:hi].reshape(b * (hi - lo), -1)
                      for g in out.router_logits)
        local = aux_from(model, piece, None if mask is None else mask[:, lo:hi])
    return float((local - full).abs() / full.abs())


def run_moe_case(case: MoeCase, rank: int, world: int) -> dict:
    ids, labels, mask = _inputs(case.data)
    ref = build_moe(case.family, case.experts)
    model = copy.deepcopy(ref)
    loss_ref, aux_ref = _outputs(ref, ids, labels, mask)
    loss_ref.backward()
    if mask is None:
        def f(i, l):
            return _outputs(model, i, l, None)
        args = (ids, labels)
    else:
        def f(i, l, a):
            return _outputs(model, i, l, a)
        args = (ids, labels, mask)
    from torch._dynamo.utils import counters
    graphs = counters["stats"]["unique_graphs"]
    step = spdsl.sp_shard(seq=world, remat=case.remat or "none", compile=case.compile,
                          shard_state=case.shard_state)(f)
    loss, aux = step(*args)
    loss.backward()
    out_graphs = counters["stats"]["unique_graphs"] - graphs    # compiled pieces of the step
    out = grad_errors(model, ref)
    out["loss"] = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
    has_aux = bool(aux_ref.item())
    out["aux"] = abs(aux.item() - aux_ref.item()) / abs(aux_ref.item()) if has_aux else 0.0
    out["aux_local"] = local_aux_error(ref, ids, mask, rank, world) if has_aux else None
    out["loss_value"] = loss.item()
    plan = spdsl.plan(step, *args)
    out["token_wise"] = sorted({v.module for v in plan.values if v.origin == "token_wise"})
    # with sharded state the MoE layers gather their parameters and scatter their gradients
    # (purpose "state"); nothing of the sequence moves
    block = f".{MOE_BLOCK.get(case.family, 'mlp')}"
    out["moe_collectives"] = [(c.kind, c.module) for c in plan.collectives
                              if block in c.module and c.purpose not in ("gradient", "state")]
    out["moe_state_collectives"] = sum(1 for c in plan.collectives
                                       if block in c.module and c.purpose == "state")
    out["graphs"] = out_graphs
    return out


def run_moe_all(rank: int, world: int, cases: list[MoeCase]) -> dict:
    torch.manual_seed(0)
    results = {}
    for case in cases:
        try:
            results[case.name] = run_moe_case(case, rank, world)
        except Exception:  # noqa: BLE001 - reported per case
            results[case.name] = {"error": traceback.format_exc()[-3000:]}
    return results


# Mixtral and Qwen3-MoE in every experts implementation, padded and under remat; the other
# families in their default (grouped_mm) experts
MAIN = ("mixtral", "qwen3_moe")
MOE_CASES = [MoeCase(f, e) for f in MAIN for e in EXPERTS_IMPLEMENTATIONS] + [
    MoeCase(f, "eager", remat="full") for f in MAIN] + [
    MoeCase(f, "grouped_mm", data="pad_right") for f in MAIN] + [
    MoeCase(f, "grouped_mm") for f in MOE_FAMILIES if f not in MAIN] + [
    MoeCase("gpt_oss", "eager", remat="fit"),       # the default: planned, then run
    MoeCase("mixtral", "grouped_mm", shard_state=True),
    MoeCase("qwen3_moe", "eager", remat="full", shard_state=True)]
