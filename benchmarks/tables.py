"""Benchmark results as markdown: the full table of docs/benchmarks.md and the README's headline rows.

Each row carries its goal and whether the figure meets it; ``replace_block`` rewrites a marked block of a file.
"""

from __future__ import annotations

from pathlib import Path

import catalog_bench
import straggler_bench

DEFAULT_REPLAY_INTERVAL = 20  # the shipped replay cadence, the replay curve's headline point


def _goal(text: str, met: bool) -> str:
    """The goal column: the goal, and whether the figure meets it."""
    return f"{text} (met)" if met else f"{text} (**missed**)"


def markdown(results: dict) -> str:
    """The full table, every section measured, under a line naming the machine."""
    lines = [_machine_line(results), "", budget_table(results), "", "| benchmark | figure | goal |", "|---|---|---|"]
    lines += _primitive_rows(results)
    lines += _hang_hook_rows(results)
    lines += _hang_real_rows(results)
    lines += _checkpoint_rows(results)
    lines += _replay_rows(results)
    lines += straggler_bench.rows(results)
    lines += straggler_bench.noise_row(results)
    lines += catalog_bench.rows(results)
    return "\n".join(lines)


def _pct(median: float, span: list[float] | tuple[float, float]) -> str:
    return f"{median * 100:+.2f} % ({span[0] * 100:+.2f} .. {span[1] * 100:+.2f})"


def _commit(results: dict, section: str) -> str:
    """The commit a section was measured on (``+dirty``: with uncommitted changes); ``-`` for results older
    than the provenance record."""
    prov = results.get("provenance", {}).get(section)
    return "-" if not prov else f"`{prov['commit']}`{'+dirty' if prov['dirty'] else ''}"


def budget_table(results: dict) -> str:
    """Issue 33's budgets side by side: each A/B with the A/A noise of the same design beside it, its goal, met
    or missed, and the commit it was measured on. Rows whose section was not measured are left out."""
    lines = ["| budget | A/B (range) | A/A noise (range) | goal | verdict | commit |", "|---|---|---|---|---|---|"]

    def row(what: str, ab: str, aa: str, goal: str, met: bool, section: str, *, noisy: bool = False,
            invalid: str = "") -> None:
        verdict = f"**invalid**: {invalid}" if invalid else "met" if met else "**missed**"
        if noisy and not invalid:
            verdict += " (within the A/A noise of the goal: not resolved)"
        lines.append(f"| {what} | {ab} | {aa} | {goal} | {verdict} | {_commit(results, section)} |")

    def beyond(goal: float, span: list[float] | tuple[float, float], median: float) -> bool:
        """The figure is closer to its goal than the A/A noise reaches: met or missed is not resolved."""
        return abs(median - goal) <= max(abs(span[0]), abs(span[1]))

    real = results.get("hang_real")
    for layout in ("ddp", "fsdp2") if real else ():
        r, step = real[layout], real.get(f"{layout}_plain_step_ms")
        row(f"hang path, real {layout.upper()} ({real['world_size']} ranks{f', {step:.0f} ms step' if step else ''}, "
            f"{real['repeats']} jobs)", _pct(r["overhead_median"], r["overhead_range"]),
            _pct(r["aa_median"], r["aa_range"]), f"<= {real['goal_ratio'] * 100:.1f} %",
            r["overhead_median"] <= real["goal_ratio"], "hang_real",
            noisy=beyond(real["goal_ratio"], r["aa_range"], r["overhead_median"]))
    for section in ("replay", "replay_long"):
        rp = results.get(section)
        for point in (rp or {}).get("curve", []):
            if point["interval"] not in (DEFAULT_REPLAY_INTERVAL, 100) or "aa_median" not in point:
                continue
            step = f", {point['step_ms']:.0f} ms step" if "step_ms" in point else ""
            wide = f" layers of {rp['width']}" if "width" in rp else ""
            row(f"replay at I={point['interval']} ({rp['world_size']} ranks, N={rp['layers']}{wide}{step}, "
                f"V={rp['variants']})",
                _pct(point["measured_ratio"], (point["min"], point["max"])),
                _pct(point["aa_median"], point["aa_range"]),
                f"<= 1.5 x V/(I*N) = {1.5 * point['model_ratio'] * 100:.2f} %",
                point["measured_ratio"] <= 1.5 * point["model_ratio"], section,
                noisy=beyond(1.5 * point["model_ratio"], point["aa_range"], point["measured_ratio"]))
    ab = results.get("snapshot_ab")
    if ab and "aa_median" in ab:
        row(f"certified snapshots at cadence {ab['cadence']} ({ab['steps']} steps, {ab['state_mb']} MB per rank, "
            f"{ab['durable_generations_min']}+ durable writes, {ab['repeats']} job triples)",
            _pct(ab["overhead_median"], (ab["overhead_min"], ab["overhead_max"])),
            _pct(ab["aa_median"], ab["aa_range"]),
            f"<= {ab['goal_overhead'] * 100:.0f} %", ab["overhead_median"] <= ab["goal_overhead"], "snapshot_ab",
            noisy=beyond(ab["goal_overhead"], ab["aa_range"], ab["overhead_median"]),
            invalid="" if ab["durable_generations_min"] else "a job made no durable write")
        row("snapshot host memory / state: at rest; peak", f"{ab['shm_at_rest_over_state']:.2f}x; "
            f"{ab['rss_peak_over_state']:.2f}x", "-", f"<= {ab['goal_at_rest_over_state']:.0f}x; "
            f"<= {ab['goal_peak_over_state']:.0f}x", ab["shm_at_rest_over_state"] <= ab["goal_at_rest_over_state"]
            and ab["rss_peak_over_state"] <= ab["goal_peak_over_state"], "snapshot_ab")
    return "\n".join(lines)


def headline(results: dict) -> str:
    """The README's short tables: the cost budgets at the shipped defaults (:func:`budget_table`), then replay's
    memory and the 1.3x straggler rate."""
    lines = [_machine_line(results), "", budget_table(results), "", "| what | figure | goal |", "|---|---|---|"]
    mem = results.get("replay_memory")
    if mem:
        figure, goal = _replay_memory_cells(mem)
        lines.append(f"| replay check memory / the sampled layer's parameters and activations | {figure} "
                     f"| {goal} |")
    lines += _replay_fixed_rows(results)
    lines += straggler_bench.headline_rows(results)
    return "\n".join(lines)


def _replay_fixed_rows(results: dict) -> list[str]:
    """Why replay misses its budget on a short step: a check's cost beyond the model's replayed passes, beside
    what its collectives cost at the latency one small all-reduce has in the same job."""
    rows = []
    for section in ("replay", "replay_long"):
        rp = results.get(section) or {}
        point = next((p for p in rp.get("curve", []) if p["interval"] == DEFAULT_REPLAY_INTERVAL), None)
        if point is None or "fixed_ms_per_check" not in point:
            continue
        latency = point["collectives_per_check"] * rp["collective_ms"]
        rows.append(f"| replay check at I={point['interval']} on a {point['step_ms']:.0f} ms step: cost beyond the "
                    f"model's replayed passes; its {point['collectives_per_check']:g} collectives at "
                    f"{rp['collective_ms']:.1f} ms each (one small all-reduce over {rp['world_size']} ranks, "
                    f"same job) | {point['fixed_ms_per_check']:.0f} ms; {latency:.0f} ms | - |")
    stages = results.get("replay_stages") or {}
    if "stages" in stages:  # where the check's time goes, every stage timed on every rank (benchmarks/replay_stages)
        st = stages["stages"]

        def ms(name: str) -> str:
            return f"{st.get(name, {}).get('mean_ms', 0):.0f}"

        if stages.get("check_cost_ms_untimed") is not None:  # every comm_timing_every-th check times it
            rows.append(f"| replay check that times the scratch all-reduce; one that does not ({stages['world']} "
                        f"ranks, A/B) | {stages['check_cost_ms_timed']:.0f} ms; {stages['check_cost_ms_untimed']:.0f}"
                        f" ms | - |")
        cost = stages.get("check_cost_ms_timed") or stages["check_cost_ms"]
        rows.append(f"| where a replay check's {cost:.0f} ms go ({stages['world']} ranks, "
                    f"{stages['step_ms']:.0f} ms step, ranks' mean): replayed passes and signing; timed all-reduces "
                    f"(the arrival skew's wait included); call broadcast; evidence exchange; metadata and agreement "
                    f"| {ms('replay (passes, signing)')}; {ms('timed collective')}; {ms('call broadcast')}; "
                    f"{ms('exchange')}; {ms('agree_inputs')} ms | - |")
    return rows


def _machine_line(results: dict) -> str:
    machine = results["machine"]
    return (f"Measured on {machine['device']} ({machine['cpu_threads']} torch thread(s)), "
            f"torch {machine['torch']}, scout-core {results['version']}.")


def _primitive_rows(results: dict) -> list[str]:
    sig = [r for r in results["signature"] if "fold_vs_sum" in r]
    many = next(r for r in results["signature"] if "surfaces" in r)
    topo = results["topology"]
    cons = results["consensus"]
    lines = []
    for r in sig:
        size = f"{r['bytes'] // 2**20} MiB {r['dtype']}"
        fold_goal = _goal(f">= {r['goal_fold_vs_sum']}x", r["fold_vs_sum"] >= r["goal_fold_vs_sum"])
        lines.append(f"| signature fold, {size} | {r['fold_vs_sum']}x of `torch.sum` "
                     f"({r['fold_gb_s']} vs {r['sum_gb_s']} GB/s) | {fold_goal} |")
        lines.append(f"| full signature incl. non-finite gate, {size} | {r['signature_vs_sum']}x of `torch.sum` | - |")
    world = f"{topo['world_size']:,} ranks"
    goal = f"< {topo['goal_s']:.0f} s"
    lines += [
        f"| `sign_many`, {many['surfaces']} surfaces of 16 KiB, one transfer "
        f"| {many['sign_many_us_per_surface']} us per surface | - |",
        f"| peer groups at {world} | {topo['peer_groups_s'] * 1e3:.1f} ms ({topo['groups']} groups) "
        f"| {_goal(goal, topo['peer_groups_s'] < topo['goal_s'])} |",
        f"| FSDP + TP groups at {world} | {topo['fsdp_and_tp_groups_s'] * 1e3:.1f} ms "
        f"| {_goal(goal, topo['fsdp_and_tp_groups_s'] < topo['goal_s'])} |",
        f"| cross-group intersection at {world} | {topo['intersection_s'] * 1e3:.1f} ms | - |",
        f"| exact C3, N=16 / N=1024 | {cons['exact_n16_us']} us / {cons['exact_n1024_us']} us | - |",
        f"| statistical C3, N=16 / N=1024 | {cons['statistical_n16_us']} us / {cons['statistical_n1024_us']} us | - |",
    ]
    return lines


def _hang_hook_rows(results: dict) -> list[str]:
    hang = results["hang"]
    publish_goal = _goal(f"<= {hang['goal_publish_us']} us", hang["tracker_mark_us"] <= hang["goal_publish_us"])
    hooks_goal = _goal(f"<= {hang['goal_ratio'] * 100:.1f} %", hang["overhead_ratio"] <= hang["goal_ratio"])
    lines = [
        f"| progress publish (record / tracker with lock) | {hang['record_publish_us']} us "
        f"/ {hang['tracker_mark_us']} us | {publish_goal} |",
        f"| collective intent: fingerprint + publish | {hang['collective_intent_us']} us | - |",
        f"| all hang-path hooks on a {hang['step_ms']:.0f} ms training step ({hang['publishes_per_step']} publishes): "
        f"measured A/B, median of 3 runs (range) / accounted | {hang['overhead_ratio'] * 100:+.2f} % "
        f"({hang['overhead_range'][0] * 100:+.2f} .. {hang['overhead_range'][1] * 100:+.2f} %) "
        f"/ {hang['accounted_ratio'] * 100:.3f} % "
        f"| {hooks_goal} |",
    ]
    wb = hang["with_backward_marks"]
    lines.append(
        f"| same, with `observer.layer_backward_marks` ({wb['publishes_per_step']} publishes) "
        f"| {wb['overhead_ratio'] * 100:+.2f} % (+-{wb['noise_ratio'] * 100:.2f} %) | - |")
    lat = hang["latency"]
    for row in lat["cells"]:
        latency_goal = _goal(
            f"<= {lat['goal_beyond_threshold_s']:.0f} s / <= {lat['goal_startup_s']:.0f} s",
            row["beyond_threshold_s"] <= lat["goal_beyond_threshold_s"]
            and row["observer_startup_max_s"] <= lat["goal_startup_s"])
        lines.append(
            f"| `{row['cell']}`, 16 ranks, {hang['latency']['threshold_s']:.0f} s threshold: verdict after threshold "
            f"/ observer start-up (max rank) | {row['beyond_threshold_s']:.2f} s "
            f"/ {row['observer_startup_max_s']:.2f} s "
            f"| {latency_goal} |")
    return lines


def _hang_real_cells(real: dict, layout: str) -> tuple[str, str]:
    """Figure and goal of the hang path's A/B on a real job of one layout."""
    r = real[layout]
    figure = (f"{r['overhead_median'] * 100:+.2f} % ({r['overhead_range'][0] * 100:+.2f} .. "
              f"{r['overhead_range'][1] * 100:+.2f} %); A/A noise {r['aa_median'] * 100:+.2f} % "
              f"({r['aa_range'][0] * 100:+.2f} .. {r['aa_range'][1] * 100:+.2f} %)")
    return figure, _goal(f"<= {real['goal_ratio'] * 100:.1f} %", r["overhead_median"] <= real["goal_ratio"])


def _hang_real_rows(results: dict) -> list[str]:
    rows = []
    real = results.get("hang_real")
    if real:
        for layout in ("ddp", "fsdp2"):
            r = real[layout]
            figure, goal = _hang_real_cells(real, layout)
            step = real.get(f"{layout}_plain_step_ms")
            rows.append(f"| hang path through `enable()` on real {layout.upper()} ({real['world_size']} ranks"
                        f"{f', {step:.0f} ms step' if step else ''}; A/B inside each job, median of "
                        f"{real['repeats']} jobs (range)) | {figure} | {goal} |")
            if r.get("torch_hook_median") is not None:
                rows.append(f"| same job, a plain copy with torch's own Python DDP comm hook (`allreduce_hook`) | "
                            f"{_pct(r['torch_hook_median'], r['torch_hook_range'])} | - |")
            if r["detail_median"] is None and not r["detail_failed"]:
                continue  # --quick runs no DETAIL jobs
            detail_fig = (f"{r['detail_median'] * 100:+.1f} % ({r['detail_range'][0] * 100:+.1f} .. "
                          f"{r['detail_range'][1] * 100:+.1f} %)") if r["detail_median"] is not None else (
                f"crashed: {r['detail_failed']}")
            rows.append(f"| same model, `TORCH_DISTRIBUTED_DEBUG=DETAIL` jobs vs plain jobs | {detail_fig} | - |")
    stall = results.get("stall_to_verdict")
    if stall:
        for row in stall["rows"]:
            goal = _goal(f"<= {stall['goal_s_for_1s_steps']:.0f} s", (row["stall_to_verdict_s"] or 1e9)
                         <= stall["goal_s_for_1s_steps"]) if row["step_s"] == 1.0 else "-"
            rows.append(f"| stall to verdict at the shipped defaults, {row['step_s']:g} s steps (threshold in force "
                        f"{row['threshold_s']} s) | {row['stall_to_verdict_s']} s | {goal} |")
    for sim in results.get("scale", []):
        rows.append(
            f"| one hang episode at {sim['world']:,} ranks (simulated; peer groups of {sim['peer_group_size']}): "
            f"messages / bytes per observer, group leader, reporter; store total "
            f"| {sim['observer']['messages_max']} / {sim['observer']['bytes_max'] / 1e3:.1f} kB, "
            f"{sim['group_leader']['messages_max']} / {sim['group_leader']['bytes_max'] / 1e6:.2f} MB, "
            f"{sim['reporter']['messages_max']} / {sim['reporter']['bytes_max'] / 1e6:.2f} MB; "
            f"{sim['store_messages']:,} msgs, {sim['store_bytes'] / 1e6:.0f} MB "
            f"(healthy: {sim['healthy_store_messages_per_s']:,} checks/s) | O(1) per observer |")
    return rows


def _snapshot_ab_cells(ab: dict) -> tuple[str, str]:
    """Figure and goal of the snapshot A/B through enable(): step time B/A - 1."""
    met = "met" if ab["overhead_median"] <= ab["goal_overhead"] else "**missed**"
    figure = (f"{ab['overhead_median'] * 100:.2f} % ({ab['overhead_min'] * 100:.2f} .. "
              f"{ab['overhead_max'] * 100:.2f} %)")
    return figure, f"<= {ab['goal_overhead'] * 100:.0f} % ({met})"


def _snapshot_memory_figure(ab: dict) -> str:
    return f"{ab['rss_peak_over_state']:.2f}x / {ab['shm_at_rest_over_state']:.2f}x"


def _checkpoint_rows(results: dict) -> list[str]:
    ck = results["checkpoint"]
    capture_goal = _goal(f"<= {ck['goal_ratio'] * 100:.0f} % at the default cadence",
                         ck["blocking_ratio_at_cadence_20"] <= ck["goal_ratio"])
    lines = [
        f"| snapshot capture, training-thread blocking / step time ({ck['state_mb']} MB of state): "
        f"capture every step / at the default cadence (20) | {ck['blocking_ratio_capture_every_step'] * 100:.2f} % "
        f"/ {ck['blocking_ratio_at_cadence_20'] * 100:.3f} % | {capture_goal} |",
        f"| restore {ck['state_mb']} MB: from memory / from the durable store (checksum + weights_only load) "
        f"| {ck['restore_from_memory_s'] * 1e3:.0f} ms / {ck['restore_from_disk_s'] * 1e3:.0f} ms | - |",
        f"| persist one shard (write, fsync, rename, sidecar) | {ck['persist_write_s'] * 1e3:.0f} ms | - |",
    ]
    ab = results["snapshot_ab"]
    figure, goal = _snapshot_ab_cells(ab)
    lines += [
        f"| certified snapshots through `enable()`, step time B/A - 1 ({ab['state_mb']} MB of state per rank, "
        f"2 ranks, capture + replica + durable write at cadence {ab['cadence']}, background included): median "
        f"(min..max) | {figure} | {goal} |",
        f"| snapshot host memory per rank / its state: peak process RSS growth beyond the run without "
        f"snapshots / RAM-backed slots at rest "
        f"| {_snapshot_memory_figure(ab)} | - |",
    ]
    return lines


def _replay_point_cells(r: dict) -> tuple[str, str]:
    """Figure and goal of one point of the replay curve (goal: within 1.5x of the paper's model)."""
    figure = f"{r['measured_ratio'] * 100:+.2f} % ({r['min'] * 100:+.1f} .. {r['max'] * 100:+.1f} %)"
    goal = (f"paper model V/(I*N) = {r['model_ratio'] * 100:.2f} % "
            f"{'(met)' if r['measured_ratio'] <= 1.5 * r['model_ratio'] else '(**missed**)'}")
    return figure, goal


def _replay_memory_cells(mem: dict) -> tuple[str, str]:
    goal = mem.get("goal_over_layer", 4.0)
    return f"{mem['peak_over_layer']:.2f}x", _goal(f"<= {goal:.0f}x", mem["peak_over_layer"] <= goal)


def _replay_rows(results: dict) -> list[str]:
    rows = []
    rp = results.get("replay")
    if rp and "curve" in rp:
        for r in rp["curve"]:
            figure, goal = _replay_point_cells(r)
            rows.append(
                f"| replay in a {rp['world_size']}-rank DDP job (exchanges included), step time B/A - 1 at check "
                f"interval I={r['interval']} (N={rp['layers']} layers of {rp['width']}, V={rp['variants']}): "
                f"median (min..max) | {figure} | {goal} |")
    mem = results.get("replay_memory")
    if mem:
        figure, goal = _replay_memory_cells(mem)
        rows.append(
            f"| replay check memory: peak resident growth / the sampled layer's parameter + activation bytes "
            f"({mem['width']} wide, batch {mem['batch']}) | {figure} | {goal} |")
    return rows


def replace_block(path: Path, name: str, table: str) -> None:
    """Rewrite what stands between ``<!-- NAME:start -->`` and ``<!-- NAME:end -->`` in ``path``."""
    text = path.read_text()
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    if start not in text or end not in text:
        raise SystemExit(f"{path} lacks the {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{start}\n{table}\n{end}{tail}")
