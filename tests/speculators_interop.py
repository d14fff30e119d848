"""Runs vllm-project/speculators' own code on EAGLE-3 heads, in its own environment.

  <speculators venv>/bin/python tests/speculators_interop.py JOBS.json

JOBS.json is a list of jobs; each writes its results to the .npz file `out`:
  {"op": "forward", "dir": D, "inputs": NPZ, "out": NPZ}
      Eagle3DraftModel.from_pretrained(D) (speculators' config validation and weight
      loading, the verifier's embedding when D has none); its forward (one TTT step) on
      the inputs' fused hidden states, tokens and positions; the draft logits it computes.
  {"op": "init_save", "verifier": V, "dir": D, "seed": S, "draft_vocab_size": Vd,
   "layer_ids": [...], "inputs": NPZ, "out": NPZ, "flags": {...}}
      a head initialised by Eagle3DraftModel.from_training_args for verifier V, the
      weights its training changes then drawn at random (torch seed S), saved with
      save_pretrained to D; its logits on the inputs.
  {"op": "convert", "dir": D, "verifier": V, "to": D2, "layer_ids": [...], "out": NPZ}
      speculators' legacy converter (Eagle3Converter, given the aux layer ids as its CLI
      takes them) turns the original-layout head D into its format at D2; the missing and
      unexpected keys it reports.
Inputs hold hidden_states [1, T, 3D] float32, input_ids [1, T], position_ids [1, T] and,
for init_save, d2t [Vd] (absolute target ids).
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch


def _forward(model, inputs) -> np.ndarray:
    captured = []
    model.lm_head.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
    ids = torch.as_tensor(inputs["input_ids"], dtype=torch.long)
    with torch.no_grad():
        model(hidden_states=torch.as_tensor(inputs["hidden_states"]), input_ids=ids,
              document_ids=torch.zeros_like(ids),
              position_ids=torch.as_tensor(inputs["position_ids"], dtype=torch.long),
              ttt_steps=1)
    return captured[0].float().numpy()


def forward(job):
    from speculators.models.eagle3 import Eagle3DraftModel

    model = Eagle3DraftModel.from_pretrained(job["dir"]).float().eval()
    return {"logits": _forward(model, np.load(job["inputs"]))}


def init_save(job):
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig

    inputs = np.load(job["inputs"])
    verifier = AutoConfig.from_pretrained(job["verifier"])
    verifier.num_hidden_layers = 1  # the draft's decoder layers
    vocab = verifier.vocab_size
    d2t = torch.as_tensor(inputs["d2t"], dtype=torch.long)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[d2t] = True
    torch.manual_seed(job["seed"])
    model = Eagle3DraftModel.from_training_args(
        verifier, t2d=t2d, d2t=d2t - torch.arange(len(d2t)),
        draft_vocab_size=job["draft_vocab_size"], ttt_steps=3,
        verifier_name_or_path=job["verifier"], target_layer_ids=job["layer_ids"],
        draft_attn_impl="simple_flex_attention", **{"norm_before_residual": False, **job["flags"]})
    with torch.no_grad():  # trained-looking weights: all it trains random, norms included
        for name, p in model.named_parameters():
            if not name.startswith(("verifier_", "embed_tokens")):  # frozen in its training
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if p.ndim == 1
                        else 0.2 * torch.randn_like(p))
    model.save_pretrained(job["dir"])
    return {"logits": _forward(model.float().eval(), inputs)}


def convert(job):
    from loguru import logger
    from speculators.convert.eagle.eagle3_converter import Eagle3Converter

    messages = []
    sink = logger.add(lambda m: messages.append(str(m)), level="WARNING")
    Eagle3Converter().convert(job["dir"], job["to"], base_model=job["verifier"],
                              validate=True,
                              eagle_aux_hidden_state_layer_ids=job["layer_ids"])
    logger.remove(sink)
    bad = [m for m in messages if "Missing keys" in m or "Unexpected keys" in m]
    return {"key_problems": np.asarray(len(bad)), "report": np.asarray("\n".join(bad))}


OPS = {"forward": forward, "init_save": init_save, "convert": convert}

if __name__ == "__main__":
    for job in json.loads(open(sys.argv[1]).read()):
        np.savez(job["out"], **OPS[job["op"]](job))
        print(f"done {job['op']} -> {job['out']}", flush=True)
