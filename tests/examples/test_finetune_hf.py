"""``examples/finetune_hf.py --model-dir``: a local model directory (a tiny Llama and a
word-level tokenizer, built here with ``save_pretrained``; nothing downloaded) fine-tuned on
text its own tokenizer turns into ids, the windows of that text, and the run on 2 ranks."""

from __future__ import annotations

import argparse
import ast
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "finetune_hf.py"
TEXT = ast.get_docstring(ast.parse(SCRIPT.read_text()), clean=False)


def _tokenizer(text: str):
    """A word-level tokenizer whose vocabulary is the words of ``text``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(text.splitlines(),
                            trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def model_dir(path: Path, text: str = TEXT) -> Path:
    """``path`` holding a tiny Llama and a tokenizer for ``text``, as ``save_pretrained``
    writes them (what ``from_pretrained(path, local_files_only=True)`` reads)."""
    import torch
    import transformers
    tok = _tokenizer(text)
    cfg = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def test_windows_are_the_text_in_the_directorys_tokens(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    import torch
    from finetune_hf import text_documents
    text = "the quick brown fox jumps over the lazy dog\nand the dog sleeps on"
    (tmp_path / "notes.txt").write_text(text)
    d = model_dir(tmp_path / "model", text)
    args = argparse.Namespace(model_dir=str(d), text=str(tmp_path / "notes.txt"), seq=64)
    document, source = text_documents(args, vocab=1000)
    words = text.split()
    assert source == f"{args.text}, {len(words)} tokens by the tokenizer in {d}"
    ids = _tokenizer(text)(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(words) and 1 not in ids         # no [UNK]: every word is known
    for seed in range(5):
        got = document(torch.Generator().manual_seed(seed), 30).tolist()
        # 30 consecutive tokens of the text from some start, wrapping round its end
        assert any(got == [ids[(s + i) % len(ids)] for i in range(30)]
                   for s in range(len(ids))), got


def test_text_ids_must_fit_the_model(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from finetune_hf import text_documents
    d = model_dir(tmp_path / "model")
    args = argparse.Namespace(model_dir=str(d), text=None, seq=64)
    with pytest.raises(SystemExit, match="each below its vocab_size 3"):
        text_documents(args, vocab=3)


@pytest.mark.multirank
@pytest.mark.slow
def test_model_dir_fine_tunes_on_two_ranks(tmp_path):
    d = model_dir(tmp_path / "tiny-llama")
    torchrun = Path(sys.executable).with_name("torchrun")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=2", str(SCRIPT),
                          "--model-dir", str(d), "--steps", "3", "--seq", "64"],
                         capture_output=True, text=True, env=env, timeout=300, cwd=ROOT,
                         check=False)
    out = run.stdout.replace("\r", "\n")
    assert run.returncode == 0, out + run.stderr[-3000:]
    assert "LlamaForCausalLM (sdpa), sequence 64 split over 2 ranks" in out, out
    n_words = len(_tokenizer(TEXT)(TEXT, add_special_tokens=False)["input_ids"])
    assert f"text: this script's docstring, {n_words:,} tokens by the tokenizer in {d}" in out
    losses = {int(s): float(v) for s, v in re.findall(r"step (\d+)/3 \w+ +loss (\S+)", out)}
    assert sorted(losses) == [1, 2, 3] and all(math.isfinite(v) for v in losses.values()), out
    (errs,) = re.findall(r"loss rel err (\S+), max gradient rel err (\S+)", out)
    assert float(errs[0]) < 1e-5 and float(errs[1]) < 1e-4, out
