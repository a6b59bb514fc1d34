"""The stress report: one JSON-ready dict, its verdict, and a printed summary."""

from __future__ import annotations

from collections import Counter
from typing import Any

from tiering.apps.stress.accounting import FaultAccount, loss_kind
from tiering.apps.stress.config import StressConfig
from tiering.apps.stress.harness import StressHarness
from tiering.apps.stress.memory import kernel_peak_rss_bytes

#: Reasons listed in full in a report; beyond that only counts are kept.
MAX_REASONS = 200

_BYTE_FIELDS = (
    "bytes_device_to_host", "bytes_device_to_disk", "bytes_host_to_disk",
    "bytes_host_to_device", "bytes_disk_to_device",
)
_DISK_FIELDS = (
    "writes", "reads", "bytes_written", "bytes_read", "refusals", "write_faults", "read_faults",
    "corruptions", "timeouts", "fault_errnos",
)


def build_report(
    config: StressConfig,
    harness: StressHarness,
    account: FaultAccount,
    errors: list[str],
    duration_s: float,
) -> dict[str, Any]:
    """Everything a run measured, under the keys operators read (see ``tiering stress``)."""
    counts = harness.counts
    kv_stats = harness.kv_stats()
    disk_stats = harness.disk_stats()
    reasons = [reason for _, reason in harness.lost]
    report: dict[str, Any] = {
        "seed": config.seed,
        "faults": list(config.faults),
        "device": config.device,
        "duration_s": round(duration_s, 3),
        "steps": counts.steps,
        "operations": counts.operations,
        "bytes_moved": int(sum(kv_stats[f] for f in _BYTE_FIELDS)),
        "faults_injected": account.injected,
        "faults_survived": account.survived,
        "faults_lost": account.lost,
        "faults_unaccounted": account.unaccounted,
        "accounting_problems": list(account.problems),
        "requests_lost": {
            "count": len(harness.lost),
            "by_kind": dict(Counter(loss_kind(r) for r in reasons)),
            "reasons": reasons[:MAX_REASONS],
            "reasons_left_out": max(0, len(reasons) - MAX_REASONS),
        },
        "data_errors": counts.data_errors,
        "data_error_examples": list(harness.data_error_examples),
        "integrity_violations": counts.integrity_violations,
        "integrity_examples": list(harness.integrity_examples),
        "integrity_checks": counts.integrity_checks,
        "peak_rss_bytes": max(kernel_peak_rss_bytes(), harness.rss.peak),
        "rss": harness.rss.as_dict(),
        "requests": counts.as_dict(),
        "device_occupancy_mean": round(harness.occupancy_total / max(1, counts.steps), 4),
        "moves": {k: v for k, v in kv_stats.items() if k != "reload_stall_s_total"},
        "controller": {k: v for k, v in harness.tkv.stats("controller").items()
                       if isinstance(v, (int, float))},
        "disk": {k: disk_stats[k] for k in _DISK_FIELDS},
        "errors": list(errors),
        "paths": list(config.paths),
        "removal_in_flight": {
            "removed": counts.removed_in_flight,
            "by_state": {"offloading": counts.removed_offloading,
                         "demoting": counts.removed_demoting,
                         "reloading": counts.removed_reloading},
            "copies_failed": counts.removed_copies_failed,
            "faults_on_removed": dict(account.on_removed or {}),
        },
        "id_reuse": {
            "reused": counts.reused,
            "reused_while_old_copy_in_flight": counts.reused_while_in_flight,
            "reused_reads_verified": counts.reused_reads_verified,
        },
    }
    if config.has("reattach"):
        report["reattach"] = {
            "restarts": counts.restarts,
            "reattached": counts.reattached,
            "verified_bit_for_bit": counts.reattach_verified,
            "lost_to_injected_faults": counts.reattach_lost_to_faults,
            "recomputed_after_restart": counts.restart_recomputed,
            "problems": list(harness.restart_problems),
        }
    if config.has("second_open"):
        outcome = harness.second_open
        report["second_open"] = (
            outcome.as_dict() if outcome is not None
            else {"refused": False, "problems": ["the second-open check did not run"]}
        )
        report["second_open"]["discarded_after"] = counts.second_open_discarded
        report["second_open_refused"] = bool(outcome is not None and outcome.refused)
    report["ok"] = failures(report) == []
    return report


def failures(report: dict[str, Any]) -> list[str]:
    """Why a run failed, in words; empty when it passed."""
    out = []
    if report["data_errors"]:
        out.append(f"{report['data_errors']} data error(s): wrong bytes were read back")
    if report["integrity_violations"]:
        out.append(f"{report['integrity_violations']} integrity violation(s)")
    if any(report["faults_unaccounted"].values()) or report["accounting_problems"]:
        out.append("injected faults not accounted for")
    if report["errors"]:
        out.append(f"{len(report['errors'])} unexpected error(s)")
    crash = report.get("crash")
    if crash is not None and crash["problems"]:
        out.append("crash check: " + "; ".join(crash["problems"]))
    reattach = report.get("reattach")
    if reattach is not None:
        if reattach["problems"]:
            out.append("reattach: " + "; ".join(reattach["problems"]))
        if reattach["restarts"] == 0:
            out.append("reattach: the cache was never restarted")
    second = report.get("second_open")
    if second is not None and (second["problems"] or not report.get("second_open_refused")):
        out.append("second open: " + "; ".join(second["problems"] or ["not refused"]))
    return out


def format_report(report: dict[str, Any]) -> str:
    """A short human-readable summary of a report."""
    mib = 1 << 20
    lines = [
        f"tiering stress on {report['device']}: seed {report['seed']}, faults "
        f"{','.join(report['faults']) or 'none'}, {report['duration_s']:.1f} s, "
        f"{report['steps']} steps, {report['operations']} operations",
        f"  moved {report['bytes_moved'] / mib:.1f} MiB; "
        f"offloads {report['moves']['offloads_to_host'] + report['moves']['offloads_to_disk']}, "
        f"demotions {report['moves']['demotions']}, reloads "
        f"{report['moves']['reloads_from_host'] + report['moves']['reloads_from_disk']} "
        f"({report['requests']['reloads_verified']} read back and verified)",
        f"  device occupancy {report['device_occupancy_mean']:.2f} on average; at the high "
        f"watermark or above in {report['requests']['steps_at_high']} of {report['steps']} "
        f"steps; {report['requests']['waits']} steps waited for copies",
        f"  {'fault':<14}{'injected':>10}{'survived':>10}{'lost':>8}{'unaccounted':>13}",
    ]
    for kind, n in report["faults_injected"].items():
        lines.append(
            f"  {kind:<14}{n:>10}{report['faults_survived'][kind]:>10}"
            f"{report['faults_lost'][kind]:>8}{report['faults_unaccounted'][kind]:>13}"
        )
    lost = report["requests_lost"]
    lines += [
        f"  requests lost: {lost['count']} {lost['by_kind'] or ''} "
        f"(recomputed {report['requests']['recomputed']})",
        f"  data errors: {report['data_errors']}   integrity violations: "
        f"{report['integrity_violations']} (of {report['integrity_checks']} checks)",
        f"  peak RSS: {report['peak_rss_bytes'] / mib:.0f} MiB (start "
        f"{report['rss']['start_bytes'] / mib:.0f}, after warm-up "
        f"{report['rss']['after_warmup_bytes'] / mib:.0f}, end "
        f"{report['rss']['end_bytes'] / mib:.0f} MiB)",
    ]
    lines.append(
        f"  removed in flight: {report['removal_in_flight']['removed']} "
        f"{report['removal_in_flight']['by_state']}, their failed copies "
        f"{report['removal_in_flight']['copies_failed']}; ids reused "
        f"{report['id_reuse']['reused']} ({report['id_reuse']['reused_while_old_copy_in_flight']}"
        f" while the old copy ran, {report['id_reuse']['reused_reads_verified']} reads verified)"
    )
    reattach = report.get("reattach")
    if reattach is not None:
        lines.append(
            f"  reattach: {reattach['restarts']} restarts, {reattach['reattached']} requests came "
            f"back, {reattach['verified_bit_for_bit']} verified bit for bit, "
            f"{reattach['lost_to_injected_faults']} lost to injected faults, "
            f"{reattach['recomputed_after_restart']} recomputed"
        )
    second = report.get("second_open")
    if second is not None:
        lines.append(
            f"  second open on the live path: refused {str(report['second_open_refused']).lower()}"
            f", data unchanged {str(second.get('data_unchanged')).lower()}"
            + (f" ({second.get('error_type')}: {second.get('error')})" if second.get("error")
               else "")
        )
    crash = report.get("crash")
    if crash is not None:
        lines.append(
            f"  crash check: {crash['reattached']} requests reattached after the kill, "
            f"{crash['verified']} reloaded bit for bit"
        )
    for text in report["accounting_problems"] + report["errors"]:
        lines.append(f"  ! {text}")
    for text in report["data_error_examples"][:5] + report["integrity_examples"][:5]:
        lines.append(f"  ! {text}")
    verdict = failures(report)
    lines.append("  PASS" if not verdict else "  FAIL: " + "; ".join(verdict))
    return "\n".join(lines)
