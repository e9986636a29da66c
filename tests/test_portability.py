"""Capsules travel between installs: one saved where the native extension runs restores, byte
for byte, where it cannot be imported, and the other way round (one weights digest for both)."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import torch

import flashrt
import flashrt.native as native
from conftest import state_bytes

# Runs in a child process where `import flashrt.native._C` fails: everything falls back to torch/numpy.
_CHILD = r"""
import hashlib, json, sys
sys.modules["flashrt.native._C"] = None            # the extension cannot be imported here
import torch, flashrt, flashrt.native as native
ckpt, mine, theirs, out = sys.argv[1:5]
assert not native.HAVE_EXT
rt = flashrt.load(ckpt, dtype="float32", max_seq_len=64)
rt.restore(flashrt.load_capsule(theirs))     # made with the extension
a = rt.arena                                 # as conftest.state_bytes
state = torch.cat([a.data[a.fixed_begin: a.fixed_end]] + [a.bytes_of(s.name, rt.position)
                   for s in a.slots if s.spec.seq_dim == 0 and s.spec.kind != "io"])
rt.reset()
rt.prefill(list(range(3, 20)))
flashrt.save_capsule(rt.snapshot(), mine)
json.dump({"weights": rt.fingerprint["weights"],
           "state": hashlib.sha256(state.numpy().tobytes()).hexdigest()}, open(out, "w"))
"""


def test_capsules_cross_the_extension_boundary(ckpt, tmp_path):
    path = ckpt("qwen3_5")
    rt = flashrt.load(path, dtype="float32", max_seq_len=64)
    rt.prefill(list(range(5, 30)))
    flashrt.save_capsule(rt.snapshot(), tmp_path / "with_ext.capsule")
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(path), str(tmp_path / "no_ext.capsule"),
                           str(tmp_path / "with_ext.capsule"), str(tmp_path / "out.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads((tmp_path / "out.json").read_text())
    assert child["weights"] == rt.fingerprint["weights"]          # one digest, whatever the build
    mine = hashlib.sha256(state_bytes(rt).numpy().tobytes()).hexdigest()
    assert child["state"] == mine                                 # restored byte for byte there
    other = flashrt.load(path, dtype="float32", max_seq_len=64)
    other.restore(flashrt.load_capsule(tmp_path / "no_ext.capsule"))   # and the other way round
    ref = flashrt.load(path, dtype="float32", max_seq_len=64)
    ref.prefill(list(range(3, 20)))
    assert other.tokens == ref.tokens and other.position == 17
    assert (other.arena["meta.logits"] - ref.arena["meta.logits"]).abs().max() <= 1e-4
    print("extension here:", native.HAVE_EXT)


def test_weights_digest_is_sha256_of_the_tensors():
    from flashrt.models.loader import weights_digest
    a = [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(2, dtype=torch.bfloat16))]
    d = weights_digest(a)
    assert d.startswith("sha256:") and d == weights_digest(list(reversed(a)))   # order-free
    assert d != weights_digest([a[0], ("b", torch.zeros(2, dtype=torch.bfloat16))])
