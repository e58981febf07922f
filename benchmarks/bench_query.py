"""What one composed query costs: De-MINDS against mapping-only (Pic2Word's query) at batch 1, per
query mode (``run.query_mode``), and where a De-MINDS query's time goes.

    .venv/bin/python -m benchmarks.bench_query --backbone ViT-B-32 --threads 1 --json bench_query.json

* The backbone is randomly initialised (``NAME`` from open_clip, or ``--tiny`` for a smoke run);
  De-MINDS at the paper's sizes (4 queries, 6 blocks). The reference image's embedding is given:
  what the two methods differ in is the text side.
* Per mode (``eager``, ``compile``: ``DeMinds.set_query_mode``; on a CPU compile freezes the
  weights): the first call's seconds (compiling), then De-MINDS and mapping-only timed in
  alternation (``--repeats`` rounds, p50 ms), their ratio, and the largest difference of each
  embedding from eager's.
* Anatomy (eager): the prompt pass (``a photo of * , TEXT``, padding cut), the intention blocks,
  the intention prompt's pass (``* * * *``), and the bytes of weights each reads: at batch 1 a
  pass reads every weight of the tower whatever its length, so the second pass costs about what
  the first does, and it cannot start before the blocks have read the first pass's output.
Timings, so never run in the test suite (a tiny smoke row checks the script runs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from demind.backbone import FrozenCLIP
from demind.schema import BackboneConfig, ModelConfig
from demind.model import DeMinds

TEXT = "make the dog red and remove the people in the background"
PROMPT = f"a photo of * , {TEXT}"


def p50_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1000, 3)


def alternate(fns: dict[str, callable], repeats: int) -> dict[str, float]:
    """p50 ms of each function, timed in alternation so that a change of machine load hits all."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: p50_ms(t) for name, t in times.items()}


def weight_mb(module: torch.nn.Module, skip: str = "") -> float:
    return round(sum(p.numel() * p.element_size() for n, p in module.named_parameters()
                     if not (skip and n.startswith(skip))) / 2 ** 20, 1)


def anatomy(model: DeMinds, ref: torch.Tensor, repeats: int) -> dict:
    """p50 ms of the three stages of an eager De-MINDS query, and the weights each reads."""
    backbone = model.backbone
    target = backbone.encode_with_pseudo_tokens([PROMPT], model.pseudo_token(ref))
    refined = model.scale_queries(model.intention(target.tokens, target.mask))
    stages = alternate({
        "prompt_pass": lambda: backbone.encode_with_pseudo_tokens([PROMPT], model.pseudo_token(ref)),
        "intention_blocks": lambda: model.intention(target.tokens, target.mask),
        "intention_prompt_pass": lambda: backbone.encode_template_with_pseudo_tokens(model.intent_prompt, refined),
    }, repeats)
    tower = backbone.model
    text_mb = weight_mb(tower.transformer) + weight_mb(tower.ln_final)
    return {"ms": stages, "prompt_tokens": int(target.tokens.shape[1]),
            "intention_prompt_tokens": len(model.intent_prompt.split()) + 2,  # + start and end of text
            "weights_mb": {"text_transformer": text_mb, "intention_blocks": weight_mb(model.intention),
                           "mapping": weight_mb(model.mapping)}}


def bench_mode(model: DeMinds, ref: torch.Tensor, mode: str, repeats: int, eager: dict | None) -> dict:
    model.set_query_mode(mode)
    calls = {"demind": lambda: model.query(ref, [TEXT]),
             "mapping_only": lambda: model.query(ref, [TEXT], mapping_only=True)}
    out: dict = {"first_call_s": {}}
    for name, fn in calls.items():
        start = time.perf_counter()
        fn()
        out["first_call_s"][name] = round(time.perf_counter() - start, 2)
    for fn in calls.values():  # warm (a compiled path may specialise once more)
        fn(), fn()
    out["p50_ms"] = alternate(calls, repeats)
    out["demind_over_mapping_only"] = round(out["p50_ms"]["demind"] / out["p50_ms"]["mapping_only"], 3)
    embeddings = {name: fn() for name, fn in calls.items()}
    if eager is not None:
        out["max_abs_diff_from_eager"] = {name: float((embeddings[name] - eager[name]).abs().max())
                                          for name in calls}
    out["embeddings"] = embeddings
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backbone", default="ViT-B-32", help="open_clip model name, randomly initialised")
    p.add_argument("--tiny", action="store_true", help="the tests' tiny CLIP and a small De-MINDS (smoke run)")
    p.add_argument("--modes", default="eager,compile", help="query modes, comma-separated (eager first)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--precision", default="fp32", help="backbone.precision (e.g. amp_bf16)")
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = [m for m in args.modes.split(",") if m]
    if modes[0] != "eager":
        p.error("--modes must start with eager (the reference the others are compared with)")
    name, model_cfg = args.backbone, ModelConfig()
    if args.tiny:
        name = str(Path(__file__).resolve().parent.parent / "configs" / "model" / "tiny-clip.json")
        model_cfg = ModelConfig(num_queries=2, num_blocks=1, num_heads=4, mapping_hidden=16)
    torch.manual_seed(0)
    backbone = FrozenCLIP(BackboneConfig(name=name, pretrained=None, precision=args.precision))
    model = DeMinds(model_cfg, backbone).eval()
    ref = torch.randn(1, backbone.embed_dim)
    command = "python -m benchmarks.bench_query " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict = {"command": command, "backbone": args.backbone if not args.tiny else "tiny",
                     "threads": args.threads, "precision": args.precision, "load_before": os.getloadavg(), "modes": {}}
    with torch.no_grad():
        results["anatomy"] = anatomy(model, ref, args.repeats)
        eager = None
        for mode in modes:
            print(f"query mode {mode} ...", flush=True)
            out = bench_mode(model, ref, mode, args.repeats, eager)
            eager = eager or out["embeddings"]
            del out["embeddings"]
            results["modes"][mode] = out
        model.set_query_mode("eager")
    results["load_after"] = os.getloadavg()
    print_table(results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


def print_table(results: dict) -> None:
    print(json.dumps(results, indent=2))
    print(f"\n{'mode':<10} {'De-MINDS ms':>12} {'mapping-only ms':>16} {'ratio':>6} {'first call s':>13}")
    for mode, out in results["modes"].items():
        print(f"{mode:<10} {out['p50_ms']['demind']:>12.1f} {out['p50_ms']['mapping_only']:>16.1f} "
              f"{out['demind_over_mapping_only']:>6.2f} {out['first_call_s']['demind']:>13.1f}")
    a = results["anatomy"]
    print("\neager De-MINDS, p50 ms: " + ", ".join(f"{k} {v:.1f}" for k, v in a["ms"].items())
          + f" (prompt {a['prompt_tokens']} tokens, intention prompt {a['intention_prompt_tokens']})")


if __name__ == "__main__":
    raise SystemExit(main())
