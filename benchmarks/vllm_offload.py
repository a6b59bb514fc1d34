"""Multi-turn chat on a tiny Llama in vLLM: our offload backend against recompute.

Run it with the vLLM environment's interpreter (``scripts/vllm_env.sh`` builds it)::

    .venv-vllm/bin/python benchmarks/vllm_offload.py --out bench-out/vllm_offload.json

Each configuration is one engine, started in its own process, with so few KV
blocks that a conversation's history cannot stay in vLLM's own cache while the
other conversations take their turns. Configurations: ``recompute`` (no
connector: vLLM recomputes the evicted prefix), ``tiered-host`` (our backend,
host tier only), ``tiered-disk`` (a small host tier over the disk tier, block
policy ``chain``, the default), ``tiered-disk-lru`` (the same with ``lru``) and, on
a CUDA machine only, ``vllm-cpu`` (vLLM's own CPUOffloadingSpec). Reported per
configuration: median and p90 time to first token over all turns after the
first, total wall time, generated tokens per second, prefill tokens vLLM served
from cache, and the ratio of each to recompute, measured in the same run. The
first turn of every conversation (cold, identical for all) is excluded from TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

BLOCK_BYTES = 2 * 2 * 32 * 2 * 32 * 4


def _child(spec: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, dtype="float32",
                  enforce_eager=True, block_size=32, num_gpu_blocks_override=spec["blocks"],
                  max_model_len=spec["max_model_len"], max_num_seqs=4,
                  gpu_memory_utilization=0.1, disable_log_stats=False, seed=0)
    if spec.get("extra") is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "OffloadingConnector",
                                        "kv_role": "kv_both",
                                        "kv_connector_extra_config": spec["extra"]}
    llm = LLM(**kwargs)
    rng = np.random.default_rng(spec["seed"])
    system = rng.integers(1, 512, spec["system_tokens"]).tolist()
    history = [list(system) for _ in range(spec["conversations"])]
    params = SamplingParams(temperature=0.0, max_tokens=spec["reply_tokens"], ignore_eos=True,
                            detokenize=False)
    warm = llm.generate([TokensPrompt(prompt_token_ids=system[:40])], params, use_tqdm=False)
    del warm
    turns = []
    t_all = time.perf_counter()
    for turn in range(spec["turns"]):
        for c in range(spec["conversations"]):
            history[c] += rng.integers(1, 512, spec["user_tokens"]).tolist()
            t = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=history[c])], params,
                               use_tqdm=False)[0]
            wall = time.perf_counter() - t
            m = res.metrics
            ttft = float(m.first_token_latency) if m is not None and m.first_token_latency else None
            history[c] += list(res.outputs[0].token_ids)
            turns.append({"turn": turn, "conv": c, "prompt_tokens": len(res.prompt_token_ids),
                          "cached": res.num_cached_tokens, "ttft_s": ttft, "wall_s": wall,
                          "gen": len(res.outputs[0].token_ids)})
    total = time.perf_counter() - t_all
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # best effort
        pass
    return {"turns": turns, "total_s": total}


def _run(name: str, spec: dict, work: Path) -> dict:
    sp, op = work / f"{name}.spec.json", work / f"{name}.out.json"
    sp.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--child", str(sp), str(op)], env=env,
                          capture_output=True, text=True, timeout=1200)
    if proc.returncode != 0 or not op.exists():
        raise RuntimeError(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(op.read_text())


def _summary(res: dict) -> dict:
    later = [t for t in res["turns"] if t["turn"] > 0]
    ttft = np.array([t["ttft_s"] if t["ttft_s"] is not None else t["wall_s"] for t in later])
    gen = sum(t["gen"] for t in res["turns"])
    return {
        "ttft_p50_ms": float(np.median(ttft) * 1e3),
        "ttft_p90_ms": float(np.percentile(ttft, 90) * 1e3),
        "total_s": res["total_s"],
        "gen_tok_per_s": gen / res["total_s"],
        "cached_tokens": sum(t["cached"] for t in res["turns"]),
        "prompt_tokens": sum(t["prompt_tokens"] for t in res["turns"]),
    }


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        out = _child(json.loads(Path(sys.argv[2]).read_text()))
        Path(sys.argv[3]).write_text(json.dumps(out))
        sys.stdout.flush()
        os._exit(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--conversations", type=int, default=6)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=24, help="vLLM KV blocks (32 tokens each)")
    args = ap.parse_args()
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"vllm_offload: needs vLLM (run it with .venv-vllm/bin/python): {exc}", file=sys.stderr)
        return 2
    from vllm_helpers import write_tiny_llama

    from benchmarks._report import table, write_json

    work = Path(tempfile.mkdtemp(prefix="tiering-vllm-bench-"))
    host_dir = tempfile.mkdtemp(prefix="tiering-vllm-bench-",
                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        model = write_tiny_llama(work / "model")
        base = dict(model=model, blocks=args.blocks, max_model_len=(args.blocks - 1) * 32, seed=11,
                    conversations=args.conversations, turns=args.turns, system_tokens=256,
                    user_tokens=64, reply_tokens=16)
        ours = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.integrations.vllm",
                "host_dir": host_dir}
        configs = {
            "recompute": None,
            "tiered-host": dict(ours, host_bytes=512 * BLOCK_BYTES),
            "tiered-disk": dict(ours, host_bytes=16 * BLOCK_BYTES, demote_headroom=16,
                                disk_path=str(work / "disk"), disk_bytes=512 * BLOCK_BYTES),
            # the same tiers with the LRU block policy instead of the default (chain)
            "tiered-disk-lru": dict(ours, host_bytes=16 * BLOCK_BYTES, demote_headroom=16,
                                    disk_path=str(work / "disk-lru"), disk_bytes=512 * BLOCK_BYTES,
                                    policy="lru"),
        }
        if torch.cuda.is_available():
            configs["vllm-cpu"] = {"spec_name": "CPUOffloadingSpec",
                                   "cpu_bytes_to_use": 512 * BLOCK_BYTES}
        summaries = {}
        for name, extra in configs.items():
            res = _run(name, dict(base, extra=extra), work)
            summaries[name] = _summary(res)
        ref = summaries["recompute"]
        rows = []
        for name, s in summaries.items():
            s["ttft_p50_ratio"] = s["ttft_p50_ms"] / ref["ttft_p50_ms"]
            s["throughput_ratio"] = s["gen_tok_per_s"] / ref["gen_tok_per_s"]
            rows.append((name, s["ttft_p50_ms"], s["ttft_p90_ms"], s["gen_tok_per_s"],
                         s["cached_tokens"], s["prompt_tokens"], s["ttft_p50_ratio"],
                         s["throughput_ratio"]))
        print(table(rows, ("config", "ttft p50 ms", "ttft p90 ms", "gen tok/s", "cached tok",
                           "prompt tok", "ttft/recompute", "tput/recompute")))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(args.out, {"benchmark": "vllm_offload", "workload": base | {"model": "tiny-llama"},
                              "results": summaries})
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(host_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
