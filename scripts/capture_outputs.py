"""Capture what the engine computes, to compare two versions of the code bit for bit.

A refactor that should change no output (moving modules, renaming, splitting a class) is checked
by running this before and after and comparing the two JSON files exactly:

    python scripts/capture_outputs.py --out /tmp/before.json     # on the old commit
    python scripts/capture_outputs.py --out /tmp/after.json      # on the new one
    python scripts/capture_outputs.py --compare /tmp/before.json /tmp/after.json

It records, on the embedded SmolLM2 model in bf16 with genserve's CPU kernels and with torch ops:
greedy tokens of a mixed-length batch, seeded temperature-1 tokens (top-k, top-p, n = 2), the
logprobs and top alternatives of each, tokens of two requests that share a prefix-cached prompt,
and a SHA-256 of the fp32 logits of every step (so a mixed step of decode rows and prefill pieces
is compared exactly); and the simulator's per-rate results (`loadgen.sim`) at the design's scale.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys


def capture_model(kernels: bool) -> dict:
    """Tokens, logprobs and per-step logits hashes of a fixed workload on the embedded model."""
    import torch

    from engine.config import EngineConfig
    from engine.core.request import Request, SamplingParams
    from engine.gguf_file import default_gguf_path, open_gguf
    from engine.model.weights import load_gguf
    from engine.runner.builder import engine_from_weights
    from engine.runner.invariance import invariance_prompts
    torch.manual_seed(0)
    args, state = load_gguf(open_gguf(default_gguf_path()), dtype=torch.float32)
    engine = engine_from_weights(EngineConfig(num_blocks=512, dtype="bfloat16"), args, state)
    runner = engine.executor
    runner.kernels = kernels
    model = runner.model
    hashes: list[str] = []
    logits_fn = model.logits

    def recording(hidden):
        out = logits_fn(hidden)
        hashes.append(hashlib.sha256(out.float().contiguous().numpy().tobytes()).hexdigest()[:16])
        return out
    model.logits = recording
    prompts = invariance_prompts(8, args.vocab_size, seed=1)
    reqs = []
    events = []

    def submit(i, prompt, max_tokens, **sampling):
        r = Request(f"cap{i}", "cap", list(prompt), max_tokens,
                    SamplingParams(**sampling), 0.0, 0.0, on_event=events.append, eos_token_id=None)
        reqs.append(r)
        engine.submit(r)
        return r
    for i, p in enumerate(prompts[:4]):
        submit(i, p, 12, temperature=0.0, ignore_eos=True, logprobs=True, top_logprobs=3)
    engine.step()
    engine.step()                      # decode rows now; the next submissions make mixed steps
    for i, p in enumerate(prompts[4:], start=4):
        submit(i, p, 10, temperature=1.0, top_k=50, top_p=0.9, seed=100 + i, ignore_eos=True,
               logprobs=True, top_logprobs=2)
    forked = Request("cap-n2", "cap", list(prompts[0][:40]), 8,
                     SamplingParams(temperature=1.0, seed=7, ignore_eos=True), 0.0, 0.0,
                     on_event=events.append)
    forked.fork(2, [7, 8])
    reqs.append(forked)
    engine.submit(forked)
    engine.run_until_idle()
    shared = prompts[6][:300]
    for j in range(2):                 # the second reuses the first's prompt blocks
        submit(20 + j, shared + [11 + j] * 5, 6, temperature=0.0, ignore_eos=True)
        engine.run_until_idle()
    out = {"tokens": {}, "events": [], "logits_sha": hashes}
    for r in reqs + forked.children:
        out["tokens"][r.request_id] = list(r.generated)
    for e in events:
        out["events"].append([e.request_id, e.index, e.token_id, e.logprob,
                              [list(t) for t in e.top_logprobs], e.position,
                              e.finish_reason.value if e.finish_reason else None,
                              e.num_prompt_tokens, e.num_completion_tokens])
    model.logits = logits_fn
    return out


def capture_sim() -> dict:
    """The simulator's per-rate results at two rates (virtual time, the design's scale), less what
    is not a result: the wall-clock time each run took."""
    import pathlib
    import subprocess
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "loadgen", "sim", "--rate", "1,2", "--duration", "120",
                        "--out", tmp], check=True, capture_output=True)
        runs = json.loads((pathlib.Path(tmp) / "results.json").read_text())["runs"]
    for run in runs:
        run.get("engine", {}).pop("wall_s", None)
    return {"runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2)
    a = ap.parse_args()
    if a.compare:
        x, y = (json.load(open(p)) for p in a.compare)
        diffs = [k for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        for k in diffs:
            print(f"differs: {k}")
        print("identical" if not diffs else f"{len(diffs)} parts differ")
        return 1 if diffs else 0
    result = {"kernels": capture_model(True), "torch": capture_model(False), "sim": capture_sim()}
    json.dump(result, open(a.out, "w"), indent=1, sort_keys=True)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
