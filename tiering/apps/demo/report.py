"""The demo's printed summary, from the dict that ``scenario.summarize`` builds."""

from __future__ import annotations

from typing import Any

_MIB = 1024 * 1024


def _mib(n: float) -> str:
    return f"{n / _MIB:.1f} MiB"


def _rate(x: float | None, unit: str) -> str:
    return "n/a" if x is None else f"{x:,.0f} {unit}"


def format_summary(s: dict[str, Any]) -> str:
    """A few aligned lines a person reads at the end of ``tiering demo``."""
    t = s["tiers"]
    ws = t["working_set_bytes"]
    off, rel, moved = s["offloads"], s["reloads"], s["bytes_moved"]
    share = f"{100.0 * t['device_bytes'] / ws:.0f}%" if ws else "n/a"
    rows = [
        ("tiers", f"device {_mib(t['device_bytes'])} ({share} of the {_mib(ws)} working set), "
                  f"host {_mib(t['host_bytes'])}, disk {_mib(t['disk_bytes'])}"),
        ("served", f"{s['prompt_tokens']:,} prompt + {s['generated_tokens']:,} generated tokens "
                   f"in {s['steps']} steps, {s['wall_s']:.1f} s"),
        ("throughput", f"{_rate(s['tokens_per_s'], 'generated tok/s')}, "
                       f"{_rate(s['prompt_tokens_per_s'], 'prompt tok/s')}"),
        ("reference", f"all KV on the device: {s['reference_wall_s']:.1f} s, "
                      f"{_rate(s['reference_tokens_per_s'], 'generated tok/s')}"),
        ("offloads", f"device->host {off['device_to_host']}, device->disk {off['device_to_disk']},"
                     f" host->disk {off['host_to_disk']}"),
        ("reloads", f"host->device {rel['from_host']}, disk->device {rel['from_disk']}"),
        ("bytes moved", ", ".join(f"{k.replace('_to_', '->')} {_mib(v)}"
                                  for k, v in moved.items())),
        ("reload stall", f"{s['reload_stall_s']:.2f} s of reloads in flight (summed); "
                         f"{s['stalled_steps']} steps with nothing to run"),
    ]
    px = s.get("prefix")
    if px:
        h = px["hit_tokens"]
        rows += [
            ("prefix hits", f"device {h['device']:,}, host {h['host']:,}, disk {h['disk']:,} tokens; "
                            f"prefill saved {px['prefill_tokens_saved']:,} tokens "
                            f"({px['prompt_tokens_run']:,} prompt tokens run vs "
                            f"{px['reference_prompt_tokens_run']:,} in the reference)"),
            ("blocks", f"published {px['blocks_published']:,}; moved device->host "
                       f"{px['blocks_moved']['device_to_host']:,}, device->disk "
                       f"{px['blocks_moved'].get('device_to_disk', 0):,}, host->disk "
                       f"{px['blocks_moved']['host_to_disk']:,} (in {px['disk_block_writes']:,} writes), "
                       f"host->device {px['blocks_moved']['host_to_device']:,}, disk->device "
                       f"{px['blocks_moved']['disk_to_device']:,}; evicted {px['blocks_evicted']:,}"),
            ("controls", f"corrupted {px['corruptions_injected']} stored block(s), detected "
                         f"{px['corrupt_blocks_detected']}, recomputed "
                         f"{px['recomputed_after_corruption']:,} tokens; wrong root finds "
                         f"{px['wrong_root_cached_tokens']:,} cached tokens "
                         f"(right root {px['right_root_cached_tokens']:,})"),
        ]
    lw = s.get("layerwise")
    if lw:
        a, b = lw["layer"], lw["whole"]
        rows.append(("layer-wise", f"reload stall {a['stall_s']:.3f} s layer by layer vs "
                                   f"{b['stall_s']:.3f} s whole-request (until layer 0 readable"
                                   f" plus waits for later layers; {a['admitted_early']} steps"
                                   f" admitted early; {a['reloads_from_disk']} disk reloads land"
                                   " whole)"))
    lr = s.get("long_request")
    if lr:
        rows.append(("long request", f"{lr['prompt_tokens']:,}+{lr['generated_tokens']} tokens, "
                                     f"KV {_mib(lr['request_kv_bytes'])} = {lr['times_device']}x "
                                     f"the device: decode {_rate(lr['decode_tokens_per_s'], 'tok/s')}"
                                     f" streamed vs {_rate(lr['compute_only_tokens_per_s'], 'tok/s')}"
                                     f" compute only; whole run {lr['slowdown']}x"))
    width = max(len(k) for k, _ in rows)
    head = (f"tiering demo: {s['requests']} requests, seed {s['seed']}, "
            f"device {s['device']}")
    lines = [head] + [f"  {k:<{width}}  {v}" for k, v in rows]
    verdict = "true" if s["identical"] else "false"
    lines.append(f"identical: {verdict} (tokens and final logits of every request, bitwise, "
                 f"vs the unpressured run{', in both readiness modes' if lw else ''}"
                 f"{' and for the long request' if lr else ''})")
    for m in s.get("mismatches", []):
        lines.append(f"  mismatch: {m}")
    return "\n".join(lines)
