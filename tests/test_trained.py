"""The shipped trained model (flashrt/assets/pystdlib-qwen35, `python -m flashrt.dev.train`):
parity with transformers, its MTP layer as trained, its tokenizer, and speculative decoding."""
from __future__ import annotations

import json

import pytest
import torch

import flashrt
from conftest import hf_logits, hf_reference
from flashrt.assets import trained_model_path
from flashrt.core.step import StepCtx
from flashrt.lm.speculative import last_stats

PROMPTS = (
    "import os\nimport sys\n\n\ndef main(argv):\n    if len(argv) < 2:\n",
    "class Queue:\n    \"\"\"A FIFO queue.\"\"\"\n\n"
    "    def __init__(self, maxsize=0):\n        self.maxsize = maxsize\n",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, self.",
    "def _check_arg(name, value):\n    if not isinstance(value, str):\n        raise TypeError(",
)


@pytest.fixture(scope="module")
def path():
    return trained_model_path()


@pytest.fixture(scope="module")
def rt(path):
    return flashrt.load(path, dtype="float32", max_seq_len=512)


def _plain(rt, ids, n):
    """Plain greedy tokens and the logits each was picked from (for the top-2 margin rule)."""
    rt.reset()
    logits = [rt.prefill(ids)]
    toks = []
    for _ in range(n):
        toks.append(int(logits[-1].argmax()))
        logits.append(rt.decode(toks[-1]))
    return toks, torch.stack(logits[:-1])


def test_checkpoint_is_marked_trained(path, rt):
    info = json.loads((path / "flashrt_checkpoint.json").read_text())
    assert info["trained"] and not info["random_weights"] and not rt.model.random_weights
    assert 4e6 <= info["params"] <= 20e6
    assert rt.net.has_mtp and rt.model.model_type == "qwen3_5"
    types = json.loads((path / "config.json").read_text())["layer_types"]
    assert "linear_attention" in types and "full_attention" in types


def test_parity_with_transformers(path, rt):
    """Prefill (all logits) + 24 cached decodes vs transformers' one-shot forward, fp32."""
    ids = rt.tokenizer.encode(PROMPTS[0] + PROMPTS[1])
    assert len(ids) > 24
    rt.reset()
    ours = torch.cat([rt.prefill(ids[:-24], all_logits=True)] + [rt.decode(t)[None] for t in ids[-24:]])
    ref = hf_logits(hf_reference(path), ids)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_mtp_layer_is_the_trained_module(path, rt):
    """flashrt's draft head on the saved weights == flashrt.dev.train's MTP module (what was trained)."""
    from flashrt.dev.train import Trainee
    from safetensors.torch import load_file
    model = hf_reference(path)
    tr = Trainee(model.config)
    sd = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
    tr.lm.load_state_dict(model.state_dict())
    tr.mtp.load_state_dict({k[4:]: v for k, v in sd.items() if k.startswith("mtp.")})
    ids = torch.tensor(rt.tokenizer.encode(PROMPTS[2]))
    T = ids.shape[0]
    with torch.no_grad():
        h = tr.lm.model(input_ids=ids[None]).last_hidden_state
        ref = tr.lm.lm_head(tr.mtp(tr.lm.model.embed_tokens(ids[None, 1:]), h[:, :-1],
                                   tr.lm.model.rotary_emb))[0]
        rt.reset()
        hid = rt.net.hidden(rt.net.embed(ids), StepCtx(T, torch.arange(T), start=0), rt.arena, all_positions=True)
        ours = rt.net.draft(ids[1:], hid[:-1], StepCtx(T - 1, torch.arange(T - 1), start=0), rt.arena)[0]
    assert (ours - ref).abs().max().item() <= 1e-4


def test_tokenizer_round_trip_and_chat_template(path, rt):
    tok = rt.tokenizer
    assert tok.kind == "hf"
    for text in PROMPTS:
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(PROMPTS[1])) < len(PROMPTS[1]) / 2      # BPE merges, not bytes
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(str(path))
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                  add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert hf.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert set(rt.model.eos_ids) == {0, 2}


@pytest.mark.parametrize("k", [1, 3])
def test_speculative_greedy_equals_plain(rt, k):
    """Top-2 margin rule: wherever plain greedy's top-2 gap exceeds 1e-3 the tokens agree, up
    to the first near-tie (after one the continuations may legitimately part)."""
    for text in PROMPTS[:2]:
        ids = rt.tokenizer.encode(text)
        ref, ref_logits = _plain(rt, ids, 24)
        rt.reset()
        out = rt.generate(ids, max_new_tokens=24, ignore_eos=True, speculative="mtp", draft_tokens=k)
        top2 = ref_logits.topk(2, -1).values
        for i, (a, b) in enumerate(zip(out, ref)):
            if float(top2[i, 0] - top2[i, 1]) <= 1e-3:
                break
            assert a == b, (text, i)
        assert len(out) == 24 and rt.tokens == ids + out


def test_mtp_acceptance_is_well_above_zero(rt):
    """Greedy MTP drafts, k = 2, these 4 prompts x 32 tokens: 0.550 of drafts accepted (66/120)
    when this test was written (bench/speculative.py --sizes trained, 8 held-out prompts: 0.68);
    random weights accept ~0. Floor 0.25: under half the measured rate, ~1000x chance (1/4096)."""
    drafted = accepted = 0
    for text in PROMPTS:
        rt.reset()
        rt.generate(rt.tokenizer.encode(text), max_new_tokens=32, ignore_eos=True,
                    speculative="mtp", draft_tokens=2)
        st = last_stats(rt)
        assert st["accepted"] == sum(st["accepted_at"]) and st["reached_at"][0] <= st["rounds"]
        drafted, accepted = drafted + st["drafted"], accepted + st["accepted"]
    rate = accepted / drafted
    print(f"MTP acceptance k=2: {rate:.3f} ({accepted}/{drafted})")
    assert rate >= 0.25


def test_train_script_is_seeded_and_writes_a_loadable_checkpoint(tmp_path):
    """flashrt.dev.train end to end on a small corner of the stdlib (json/, 2 steps, tiny dims):
    twice with the same seed gives the same weights and tokenizer; flashrt loads the result
    with its MTP layer and matches transformers."""
    import sysconfig
    from flashrt.dev.train import main
    root = sysconfig.get_paths()["stdlib"] + "/json"
    args = ["--stdlib", root, "--val-every", "3", "--vocab", "320", "--hidden", "64",
            "--intermediate", "128", "--heads", "2", "--kv-heads", "1", "--head-dim", "32",
            "--linear-k-heads", "1", "--linear-v-heads", "2", "--linear-head-dim", "32",
            "--seq", "64", "--batch", "2", "--steps", "2", "--warmup", "1", "--val-windows", "2",
            "--eval-every", "2"]
    outs = [tmp_path / "a", tmp_path / "b"]
    threads = torch.get_num_threads()
    with torch.random.fork_rng(devices=[]):     # main() seeds and sets threads: leave ours alone
        try:
            for out in outs:
                assert main(["--out", str(out)] + args) == 0
        finally:
            torch.set_num_threads(threads)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name
    info = json.loads((outs[0] / "flashrt_checkpoint.json").read_text())
    assert info["trained"] and info["heldout"]["main_loss"] > 0
    rt = flashrt.load(outs[0], dtype="float32", max_seq_len=128)
    assert rt.net.has_mtp
    ids = rt.tokenizer.encode('import json\nprint(json.dumps({"a": 1}))\n')
    ref = hf_logits(hf_reference(outs[0]), ids)
    assert (rt.prefill(ids, all_logits=True) - ref).abs().max().item() <= 1e-4
