"""Hybrid Hugging Face causal LMs (linear attention / state-space layers beside attention):
tiny random configs, and the cases the hybrid parity test runs on every rank of one launch.

Each case returns the loss and every-gradient errors against single-device PyTorch on the same
weights and batch, and what the process group ran: all-to-alls, all-gathers and the bytes of
each, counted from the profiler's ``gloo:*`` events (what gloo executed, not spdsl's plan).
Families whose model classes this transformers release lacks are reported as missing.
"""

from __future__ import annotations

import copy
import traceback

import torch
from torch.profiler import ProfilerActivity, profile

import spdsl
from tests.hf.cases import GRAD_FLOOR, grad_errors, inputs, loss_fn
from tests.hf.families import VOCAB, batch, packed, padded
from tests.hf.varlen import fla_on_cpu, mamba_on_cpu, varlen_batch

_BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
         "attention_dropout": 0.0}

_MAMBA2 = {"mamba_n_heads": 4, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_state": 8,
           "mamba_d_conv": 4, "mamba_expand": 1, "mamba_chunk_size": 16}

# family -> (config class, model class, config keyword arguments, what it exercises)
HYBRIDS: dict[str, tuple[str, str, dict, str]] = {
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                {**_BASE, "num_hidden_layers": 4, "head_dim": 16, "linear_num_key_heads": 2,
                 "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                 "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
                 "layer_types": ["linear_attention", "full_attention"] * 2},
                "Gated DeltaNet (2 k / 4 v heads) and gated attention; causal conv before it"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   {**_BASE, "num_hidden_layers": 4, "head_dim": 16,
                    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                    "linear_conv_kernel_dim": 4, "mlp_only_layers": [0, 1, 2, 3],
                    "layer_types": ["linear_attention", "full_attention"] * 2},
                   "Gated DeltaNet (fused qkvz projection), dense MLP"),
    "bamba": ("BambaConfig", "BambaForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "attn_layer_indices": [1], **_MAMBA2},
              "Mamba-2 SSD scan and attention"),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  {**_BASE, "num_hidden_layers": 2, "head_dim": 16, **_MAMBA2,
                   "mamba_d_ssm": 64, "mamba_rms_norm": True},
                  "Mamba-2 SSD in parallel with attention in every layer"),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   {**_BASE, "num_hidden_layers": 3, "head_dim": 16,
                    "hybrid_override_pattern": "M*-", "mamba_num_heads": 4,
                    "mamba_head_dim": 16, "n_groups": 1, "ssm_state_size": 8,
                    "conv_kernel": 4, "expand": 1, "chunk_size": 16},
                   "Mamba-2, attention and MLP as separate layers"),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM",
               {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
                "num_heads": 4, "head_dim": 32, "n_groups": 1, "state_size": 8,
                "conv_kernel": 4, "expand": 2, "chunk_size": 16},
               "Mamba-2 only (no attention)"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM",
                    {**_BASE, "num_hidden_layers": 2, "num_key_value_heads": 4,
                     "kv_lora_rank": 16, "q_lora_rank": None, "qk_rope_head_dim": 8,
                     "qk_nope_head_dim": 8, "v_head_dim": 16, "linear_head_dim": 16,
                     "linear_num_heads": 4, "linear_conv_kernel_dim": 4,
                     "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
                     "layer_types": ["linear_attention", "full_attention"],
                     "mlp_layer_types": ["dense", "dense"]},
                    "Kimi delta attention (a decay per key channel; conv before it) and "
                    "multi-head latent attention"),
    "jamba": ("JambaConfig", "JambaForCausalLM",
              {**_BASE, "num_hidden_layers": 2, "num_experts": 1, "attn_layer_period": 2,
               "attn_layer_offset": 1, "mamba_d_state": 8, "mamba_d_conv": 4,
               "mamba_expand": 2, "mamba_dt_rank": 8},
              "Mamba-1 selective scan (a decay per channel and state element) and attention"),
    "mamba": ("MambaConfig", "MambaForCausalLM",
              {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
               "state_size": 8, "expand": 2, "conv_kernel": 4, "time_step_rank": 8},
              "Mamba-1 only (no attention)"),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM",
                     {"vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
                      "state_size": 8, "expand": 2, "conv_kernel": 4, "time_step_rank": 8},
                     "Mamba-1 with RMS-normalised B, C and dt (no attention)"),
    "minimax": ("MiniMaxConfig", "MiniMaxForCausalLM",
                {**_BASE, "num_hidden_layers": 2, "head_dim": 16, "intermediate_size": 32,
                 "num_local_experts": 4, "num_experts_per_tok": 2, "block_size": 8,
                 "layer_types": ["linear_attention", "full_attention"]},
                "lightning attention in blocks of 8 (inline in its module's forward), then "
                "softmax attention; experts"),
}


def build(family: str) -> torch.nn.Module:
    import transformers
    cfg_name, model_name, kw, _ = HYBRIDS[family]
    cfg_cls, model_cls = getattr(transformers, cfg_name, None), \
        getattr(transformers, model_name, None)
    if cfg_cls is None or model_cls is None:
        raise LookupError(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    cfg = cfg_cls(**kw)
    # Mamba-2 alone has no attention (and transformers refuses SDPA for it)
    cfg._attn_implementation = "sdpa" if model_cls._supports_sdpa else "eager"
    return model_cls(cfg).float().train()


def mixer_strategies(plan) -> list[str]:
    """The strategy the plan chose at each sequence mixer (``mixer.<form>.<strategy>``)."""
    return [v.origin for v in plan.values if v.origin.startswith("mixer.")]


class _MixerCalls:
    """The tensors each mixer call gets on this rank (``Site.call``, where the lowering runs
    the captured function): per call, its form, the elements of its largest tensor argument
    on this rank and of the largest one as traced (the whole sequence)."""

    def __enter__(self):
        from spdsl.propagate.mixer_form import Site
        self.calls, self._orig = [], Site.call
        calls, orig = self.calls, self._orig

        def call(site, tensors, **override):
            # the rank's own tensors (state passing widens the values and adds a halo to the
            # conv's input: what the rank computes on, not what it holds of the sequence)
            big = max(x.numel() for x in tensors)
            whole = max(torch.Size(s).numel() for s in site.shapes)
            calls.append((site.form.name, big, whole))
            return orig(site, tensors, **override)
        Site.call = call
        return self

    def __exit__(self, *exc):
        from spdsl.propagate.mixer_form import Site
        Site.call = self._orig


GLOO = ("gloo:all_to_all", "gloo:all_gather", "gloo:reduce_scatter", "gloo:all_reduce")


# long enough that splitting a mixer moves fewer bytes than gathering its inputs: at 32
# tokens the engine rightly runs Gated DeltaNet whole at SP 4 (its state, [B, 4, 16, 32] fp32
# from each of 3 ranks, is more than the sequence's q/k/v)
SEQ = 128
VARLEN_DOCS = (32, 45, 51)
# families whose mixers keep packed documents apart given them: Gated DeltaNet the bounds
# (with flash-linear-attention), Mamba-2's scan and conv each token's document (with mamba_ssm
# and causal-conv1d); on CPU ``tests.hf.varlen`` stands in for the packages
VARLEN_FLA = ("qwen3_5", "qwen3_next")
VARLEN_MAMBA = ("bamba", "nemotron_h")
VARLEN = VARLEN_FLA + VARLEN_MAMBA


def _inputs(data: str, family: str = ""):
    if data == "plain":
        ids, labels = batch(2, SEQ)
        return ("input_ids", "labels"), (ids, labels)
    if data == "pad_right":
        return ("input_ids", "labels", "attention_mask"), padded(2, SEQ, "right")
    if data == "packed":
        return ("input_ids", "labels", "position_ids"), packed(SEQ, (37, 51, 40))
    if data == "varlen":
        # the packing collator's documents too (the recurrences restart at each); at SP 4 one
        # piece starts on a document boundary (32), two inside a document (64, 96)
        ids, labels, pos, cu, seq_idx = varlen_batch(SEQ, VARLEN_DOCS)
        if family in VARLEN_FLA:
            return ("input_ids", "labels", "position_ids", "cu_seq_lens_q",
                    "cu_seq_lens_k"), (ids, labels, pos, cu, cu)
        return ("input_ids", "labels", "position_ids", "seq_idx"), (ids, labels, pos, seq_idx)
    if data == "short":
        ids, labels = batch(2, 32)
        return ("input_ids", "labels"), (ids, labels)
    return inputs(data)


def param_errors(model, ref) -> dict[str, float]:
    """Each parameter's gradient error, measured as ``grad_errors`` measures it."""
    top = max(float(q.grad.abs().max()) for q in ref.parameters() if q.grad is not None)
    return {name: float((p.grad - q.grad).abs().max())
            / max(float(q.grad.abs().max()), GRAD_FLOOR * top)
            for (name, p), q in zip(model.named_parameters(), ref.parameters())
            if p.grad is not None and q.grad is not None}


def rounding_floor(family: str, names, xs, ref) -> dict[str, float]:
    """How far fp32 rounding alone moves each gradient of one device's run: the same model
    and batch with Hugging Face's own chunked Gated DeltaNet in chunks of 32 tokens instead of
    64 (the same function, the same mathematics, another order of sums). Qwen3.5's and
    Qwen3-Next's ``A_log`` gradient of the first layer, a sum over tokens that nearly cancels,
    moves 1.3-3.1e-4 this way; the parity bound of such a gradient is twice its floor. Empty for
    the families without the chunked function."""
    import functools
    import importlib
    try:
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return {}
    orig = getattr(mod, "torch_chunk_gated_delta_rule", None)
    if orig is None:
        return {}
    other = copy.deepcopy(ref)
    other.zero_grad(set_to_none=True)
    mod.torch_chunk_gated_delta_rule = functools.partial(orig, chunk_size=32)
    try:
        loss_fn(other, names)(*xs).backward()
    finally:
        mod.torch_chunk_gated_delta_rule = orig
    return param_errors(other, ref)


def run_case(family: str, data: str, world: int, remat=None, attention=None) -> dict:
    if data == "varlen":
        with (fla_on_cpu if family in VARLEN_FLA else mamba_on_cpu)(family):
            return _run_case(family, data, world, remat, attention)
    return _run_case(family, data, world, remat, attention)


def long_memory(model: torch.nn.Module) -> None:
    """Mamba-2 layers that carry their state across many tokens: ``dt`` drawn as Mamba-2
    draws it (log-uniform in [1e-3, 1e-1]; Hugging Face's random init gives ~1.3, forgetting
    within two tokens) and the in-projection 20x (states as large as the skip path). Then
    whether a document boundary stops the state moves gradients by ~6%, not 2e-5."""
    g = torch.Generator().manual_seed(3)
    for m in model.modules():
        if isinstance(getattr(m, "dt_bias", None), torch.nn.Parameter):
            dt = torch.exp(torch.empty(m.dt_bias.shape).uniform_(-6.9, -2.3, generator=g))
            with torch.no_grad():
                m.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))      # softplus^-1
                m.in_proj.weight.mul_(20.0)


def _run_case(family: str, data: str, world: int, remat=None, attention=None) -> dict:
    names, xs = _inputs(data, family)
    ref = build(family)
    if data == "varlen" and family in VARLEN_MAMBA:
        long_memory(ref)
    model = copy.deepcopy(ref)
    loss_ref = loss_fn(ref, names)(*xs)
    loss_ref.backward()
    options = {k: v for k, v in (("remat", remat), ("attention", attention)) if v}
    step = spdsl.sp_shard(seq=world, **options)(loss_fn(model, names))
    step(*xs).backward()
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof, _MixerCalls() as seen:
        loss = step(*xs)
        loss.backward()
    out = grad_errors(model, ref)
    out["per_param"] = param_errors(model, ref)
    out["floor"] = rounding_floor(family, names, xs, ref)
    plan = spdsl.plan(step, *xs)
    out["strategies"] = mixer_strategies(plan)
    out["attention"] = [a.runs for a in plan.attention]
    out["mixer_calls"] = seen.calls
    out["loss"] = abs(loss.item() - loss_ref.item()) / abs(loss_ref.item())
    out["counts"] = {k.split(":")[1]: sum(1 for e in prof.events() if e.name == k)
                     for k in GLOO}
    return out


def run_all(rank: int, world: int, cases: list[tuple], remat=None) -> dict:
    """Each case ``(family, data)`` or ``(family, data, attention)`` (``sp_shard``'s
    ``attention=``), named ``family/data[/attention]``."""
    results = {}
    for family, data, *attention in cases:
        name = "/".join((family, data, *attention))
        try:
            results[name] = run_case(family, data, world, remat, *attention)
        except LookupError as e:
            results[name] = {"missing": str(e)}
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = {"error": traceback.format_exc()[-3000:]}
    return results
