"""Every table the bench prints, in one place, from the figures each run returns: the throughput
table and the plot, each other workload's tables (spec, moe, serve, ray among them) and the
tensor-parallel research tool's. Each is plain rows fed to `table`."""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.figures import SERVE_TARGETS


def table(head: tuple[str, int], columns: list[tuple[str, int, str]], rows: dict) -> None:
    """A header line, then a line per row: its name left-aligned in head's width, then each value
    right-aligned in its column's width and format ("-" for None); a row that is a string (why it
    did not run) is printed after its name instead."""
    print(f"{head[0]:<{head[1]}}" + "".join(f"{h:>{w}}" for h, w, _ in columns))
    for name, values in rows.items():
        if isinstance(values, str):
            print(f"{name:<{head[1]}} {values}")
            continue
        print(f"{name:<{head[1]}}" + "".join(f"{'-' if v is None else format(v, f):>{w}}"
                                              for (_, w, f), v in zip(columns, values)))


def host(m: dict) -> str:
    return f"{m['cpu']}, flags {' '.join(m['matrix_flags']) or 'none'}"


def verdict(met: bool) -> str:
    return "met" if met else "missed"


def trace_line(s: dict) -> str:
    return (f"{s['num_requests']} requests, input {s['input_len'][0]}-{s['input_len'][1]}, "
            f"output {s['output_len'][0]}-{s['output_len'][1]} tokens")


# ==== the throughput workload ============================================================

def print_table(r: dict) -> None:
    s, e, mach = r["settings"], r["engine"], r["machine"]
    print(f"\n{trace_line(s)}, seed {s['seed']}, model {Path(s['model']).name}, {mach['cpu']} "
          f"({mach['cpu_cores']} cores, {s['threads']} torch threads)")
    print(f"{s['dtype']}, cpu_linear {s['cpu_linear']}, cpu_kernels {s.get('cpu_kernels')}, attention "
          f"{s.get('attention_backend')}, batch-invariant {s.get('batch_invariant')}, quantization "
          f"{s.get('quantization')}; CPU flags {' '.join(mach['matrix_flags']) or 'none'} "
          f"(bfloat16 matrix units: {', '.join(mach['bf16_matrix_units']) or 'none'})\n")
    engines = {"nanopaged": e, **r["peers"]}
    table(("engine (measured, this run)", 30),
          [("out tok/s", 10, ".1f"), ("total tok/s", 13, ".1f"), ("req/s", 8, ".2f"), ("wall s", 9, ".2f"),
           ("vs nanopaged", 14, ".2f")],
          {name: f"not run: {f['skipped']}" if "skipped" in f else
           [f["output_tokens_per_s"], f["total_tokens_per_s"], f["requests_per_s"], f["wall_s"],
            e["output_tokens_per_s"] / f["output_tokens_per_s"]] for name, f in engines.items()})
    print_notes(r)
    pub = r["published"]
    print(f"\npublished, NOT measured here ({pub['setup']}):")
    for name, v in pub["output_tokens_per_s"].items():
        print(f"  {name:28} {v:10.2f} out tok/s")
    print_memory(r)
    print_time(r)
    print("\ntargets:")
    for name, t in r["targets"].items():
        sign = "<=" if t["lower_is_better"] else ">="
        print(f"  {name:22} " + ("n/a" if t["value"] is None else
                                 f"{t['value']:8.3f}  target {sign} {t['target']}  {'met' if t['met'] else 'MISSED'}"))


def print_notes(r: dict) -> None:
    """A line under the engine table for each run beside it and each peer that needs explaining."""
    peers, notes = r["peers"], []
    if "dense" in r:
        d = r["dense"]
        notes.append(f"nanopaged with and without quantization, alternating on the same trace, best of "
                     f"{len(d['runs']['quantized'])} and {len(d['runs']['dense'])}: "
                     f"{d['quantized_output_tokens_per_s']:.1f} and {d['output_tokens_per_s']:.1f} out tok/s "
                     f"(quantized / dense {d['ratio']:.2f}x)")
    b = r.get("batch_invariance", {})
    if b.get("same_kernels"):
        notes.append(f"batch-invariant: the same kernels with and without it here ({', '.join(b['kernels'])}): "
                     "no cost")
    elif b.get("batch_invariant"):
        notes.append(f"batch-invariant ({', '.join(b['kernels'])}) and not ({', '.join(b['kernels_off'])}), "
                     f"alternating on the same trace, best of 2 each: {b['invariant_output_tokens_per_s']:.1f} and "
                     f"{b['output_tokens_per_s']:.1f} out tok/s ({b['ratio']:.2f}x); one request at a time "
                     f"{b['single_stream_ratio']:.2f}x")
    llama = peers.get("llama.cpp", {})
    if "one_request_at_a_time" in llama:
        notes.append(f"llama.cpp {llama['version']} on {llama['gguf']}, one request at a time (its Python API "
                     "serves no batches)")
    c = peers.get("ctranslate2", {})
    if "compute_type" in c:
        notes.append(f"ctranslate2 {c['version']} at compute type {c['compute_type']} (out tok/s by type: "
                     f"{sweep(c)}; the CPU supports {', '.join(c['supported_compute_types'])}), {c['num_calls']} "
                     f"generate_batch call(s) of at most {c['max_batch_size']} requests, each row ended at its "
                     "own length")
    v = peers.get("vllm", {})
    if "identical_outputs" in v:
        notes.append(f"vllm {v['version']} in its own environment (loaded in {v['load_s']:.0f} s, the same KV "
                     f"bytes); greedy outputs identical to nanopaged's on {v['identical_outputs']} of "
                     f"{r['settings']['num_requests']} requests")
    hf = peers.get("hf", {})
    if "padding_waste" in hf:
        notes.append(f"hf at its fastest static batch size, {hf['batch_size']} (out tok/s by size: {sweep(hf)}); "
                     f"{hf['padding_waste']:.1%} of the token slots computed were padding")
    for note in notes:
        print(f"  {note}")


def sweep(peer: dict) -> str:
    return ", ".join(f"{k}: {v:.1f}" for k, v in peer["sweep"].items())


def print_memory(r: dict) -> None:
    k, m, s, hf = r["kv_utilization"], r["memory"], r["settings"], r["peers"].get("hf", {})
    print("\nKV utilization (tokens stored / slots held, every step):")
    shares = {"paged (nanopaged)": k["paged"], "reserve prompt + max_tokens": k["reserve_prompt_plus_max_tokens"],
              f"reserve max_model_len ({s['max_model_len']})": k["reserve_max_model_len"]}
    if "kv_utilization" in hf:
        shares["hf static padded cache"] = hf["kv_utilization"]
    for name, share in shares.items():
        print(f"  {name:34}{share:7.1%}")
    mr, hit = m["max_num_running"], m["prefix_cache_hit_rate"]
    print(f"  most requests at once, {m['kv_budget_tokens']} KV slots: paged {mr['paged']} "
          f"(bound by {mr['paged_bound_by']}), reserve prompt+max {mr['reserve_prompt_plus_max_tokens']}, "
          f"reserve max_model_len {mr['reserve_max_model_len']}")
    print(f"  preemptions {m['num_preemptions']}, KV usage peak {m['peak_kv_usage']:.1%} "
          f"mean {m['mean_kv_usage']:.1%}, prefix hit rate {'n/a (no lookups)' if hit is None else f'{hit:.1%}'}")


def print_time(r: dict) -> None:
    """Where a step's time goes, the roofline and the trace floor, one request at a time, quality, noise."""
    o, rf = r["overhead"], r["roofline"]
    fl, ss = rf["floor"], r["single_stream"]
    print(f"\nengine step: {o['step_ms']:.1f} ms = scheduler+block pool {o['schedule_ms_per_step']:.2f} ms "
          f"({o['schedule_share']:.1%}) + model {o['model_ms_per_step']:.1f} ms; "
          f"outside step(): {o['other_share_of_wall']:.1%} of wall")
    print(f"roofline: {rf['kernel']} {rf['kernel_flops_per_s'] / 1e9:.1f} GFLOP/s, {rf['flops_per_token'] / 1e6:.0f} "
          f"MFLOP/token -> {rf['roofline_tokens_per_s']:.0f} tok/s; nanopaged reaches {rf['fraction']:.1%}")
    print(f"trace floor: {fl['seconds']:.2f} s for nanopaged's {fl['num_steps']} steps ({fl['weight_bound_steps']} "
          f"bound by streaming {fl['weight_bytes'] / 1e6:.0f} MB of weights as stored and "
          f"{fl['kv_bytes_per_token']:,} bytes of K/V per token of context at a read's "
          f"{fl['read_bytes_per_s'] / 1e9:.1f} GB/s, the rest by arithmetic at {rf['kernel']}'s measured "
          f"{fl['kernel_flops_per_s'] / 1e9:.1f} GFLOP/s); nanopaged's wall {fl['wall_s']:.2f} s reaches "
          f"{fl['fraction']:.1%} of it")
    table(("step kind", 14), [("steps", 7, ""), ("model s", 9, ".2f"), ("floor s", 9, ".2f"),
                              ("floor/model", 13, ".1%"), ("bound by", 12, ""), ("own matmuls s", 15, ".2f")],
          {k: [v["num_steps"], v["model_s"], v["floor_s"], v["share"], v["bound_by"], v["own_matmuls_s"]]
           for k, v in fl["by_step_kind"].items()})
    print(f"one request at a time ({ss['prompt_tokens']}-token prompt, {ss['output_tokens']} tokens): decode "
          f"nanopaged {ss['nanopaged_decode_tokens_per_s']:.1f} tok/s, hf generate "
          f"{ss['hf_decode_tokens_per_s']:.1f} tok/s ({ss['ratio']:.2f}x)"
          + "".join(f", {name} {ss[f'{key}_decode_tokens_per_s']:.1f} tok/s ({ss[f'ratio_vs_{key}']:.2f}x)"
                    for name, key in (("vllm", "vllm"), ("llama.cpp", "llamacpp"))
                    if f"{key}_decode_tokens_per_s" in ss))
    if "quality" in r:
        q = r["quality"]
        print(f"perplexity of {q['text_tokens']} tokens of English: "
              + ", ".join(f"{k} {v:.3f}" for k, v in q["perplexity"].items()))
    n = r.get("noise", {})
    for name in ("nanopaged", "hf"):
        if name in n:
            k = n[name]
            print(f"beside a busy core ({n['neighbour_core']}): {name} keeps {k['kept']:.1%} of its quiet "
                  f"output tokens/s ({k['noisy_output_tokens_per_s']:.1f} of {k['quiet_output_tokens_per_s']:.1f})")


def plot(r: dict, samples: list, path: str) -> None:
    try:
        import matplotlib           # optional: only --plot draws
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); no plot drawn",
              file=sys.stderr)
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.5))
    t = [s.t for s in samples]
    for field, label in (("reserve_max_len", "reserve max_model_len"),
                         ("reserve_needed", "reserve prompt + max_tokens"),
                         ("paged", "paged: slots in blocks held"), ("stored", "tokens stored")):
        ax1.plot(t, [getattr(s, field) for s in samples], label=label)
    ax1.set_yscale("log")
    ax1.set(xlabel="seconds into the timed run", ylabel="KV slots (tokens)",
            title="KV memory held for the same running requests")
    ax1.legend(fontsize=8)
    measured = {"nanopaged": r["engine"], **{k: v for k, v in r["peers"].items() if "skipped" not in v}}
    ax2.bar(list(measured), [v["output_tokens_per_s"] for v in measured.values()])
    ax2.set(ylabel="output tokens/s", title="throughput, measured in this run")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


# ==== the workloads of benchmarks/workloads.py, structured, lora, overlap ===================

def print_shared_prefix(r: dict) -> None:
    s = r["settings"]
    print(f"\nshared prefix: {s['num_requests']} requests = {s['prefix_len']}-token system prompt + "
          f"{s['question_len'][0]}-{s['question_len'][1]}-token question, output {s['output_len'][0]}-"
          f"{s['output_len'][1]} tokens; {r['prompt_tokens']} prompt tokens")
    table(("prefix caching", 16), [("wall s", 9, ".2f"), ("prefill tokens", 16, ""), ("hit rate", 10, ".1%"),
                                   ("out tok/s", 11, ".1f")],
          {k: [r[k][x] for x in ("wall_s", "prefill_tokens_computed", "hit_rate", "output_tokens_per_s")]
           for k in ("on", "off")})
    print(f"prefill tokens computed fall by {r['prefill_reduction']:.1%} (shared fraction "
          f"{r['shared_fraction']:.1%}); speedup {r['speedup']:.2f}x (target 2x); "
          f"outputs identical: {r['identical_outputs']}")


def print_cascade(r: dict) -> None:
    s = r["settings"]
    print(f"\nshared prefixes read once: decode steps (model + sampler, best of {s['rounds']} rounds), "
          f"{s['prefix_len']}-token prefix, {s['output_len']} tokens out; {host(r['machine'])}")
    table(("workload", 16), [("rows", 6, ""), ("read once ms", 14, ".1f"), ("plain ms", 10, ".1f"),
                             ("own copies ms", 15, ".1f"), ("speedup", 9, ".2f"), ("same tokens", 13, "")],
          {name: [w["rows"], *(w["decode_step_ms"].get(k) for k in ("read once", "plain", "own copies")),
                  w["speedup"], str(w["identical_outputs"])] for name, w in r["workloads"].items()})
    print("target: decode steps >= 1.5x faster read once than plain (issue 37): " + ", ".join(
        f"{name} {verdict(w['speedup'] >= 1.5)}" for name, w in r["workloads"].items()))


PHASES = ("schedule", "prepare", "forward", "wait", "sample", "update", "output")


def print_overlap(r: dict) -> None:
    print(f"\nasync scheduling off vs on (fastest of {r['settings']['rounds']} rounds each; ms per step by "
          f"phase; busy: the share of the steps' wall time the forward pass ran); {host(r['machine'])}")
    table(("workload", 24), [("out tok/s", 11, ".1f"), ("step ms", 9, ".2f"), *((p, 9, ".2f") for p in PHASES),
                             ("busy", 7, ".1%")],
          {f"{name}, {mode}": [f["output_tokens_per_s"], f["step_wall_ms"], *(f["step_ms"].get(p) for p in PHASES),
                               f["model_busy_share"]]
           for name, w in r["workloads"].items() for mode, f in (("off", w["off"]), ("on", w["on"]))})
    for name, w in r["workloads"].items():
        on, gain = w["on"]["model_busy_share"], w["speedup"] - 1
        print(f"{name}: same tokens {w['identical_outputs']}; targets (issue 54): busy >= 97% with it on "
              f"{on:.1%} {verdict(on >= 0.97)}; out tok/s +{gain:.1%} against the non-model share "
              f"off {w['non_model_share_off']:.1%}: {verdict(gain >= w['non_model_share_off'])}")


def print_hybrid(r: dict) -> None:
    s, m = r["settings"], r["memory"]
    print(f"\n{s['architecture']}: memory per request of {m['context']:,} tokens (block size {m['block_size']}), "
          f"and a question after a {s['prefix_len']:,}-token shared prompt; {host(r['machine'])}")
    mb = 1e6
    table(("model", 28), [("K/V B/token", 13, ",d"), ("state MB", 10, ".2f"), ("request MB", 12, ".1f"),
                          ("requests fit", 14, ",d")],
          {"hybrid, as paged": [m["kv_bytes_per_token"], m["state_bytes_per_request"] / mb, m["paged_bytes"] / mb,
                                m["requests_at_context"]],
           "hybrid, as filled": [m["kv_bytes_per_token"], None, m["filled_bytes"] / mb, None],
           "full attention, same shape": [m["full_attention_bytes"] // m["context"], 0.0,
                                          m["full_attention_bytes"] / mb, m["full_attention_requests"]]})
    print(f"time to first token: hit {r['ttft_hit_s']:.3f} s (the kept state restored), miss {r['ttft_miss_s']:.3f} s: "
          f"{r['ttft_speedup']:.1f}x; target (issue 57) >= 5x {verdict(r['ttft_speedup'] >= 5)}")


def print_multimodal(r: dict) -> None:
    s, e, mm = r["settings"], r["engine"], r["engine"]["multimodal"]
    print(f"\nmultimodal: {s['random_weights'] or s['model']}, {s['num_requests']} chat requests (a question, then one "
          f"of {s['distinct_images']} images of {', '.join(f'{w}x{h}' for w, h in s['image_sizes'])} pixels), "
          f"{s['max_tokens']} tokens out each, greedy; {s['threads']} threads, {s['dtype']}; {host(r['machine'])}")
    rows = {"nanopaged": e}
    if "vllm" in r:
        rows[f"vLLM CPU {r['vllm'].get('version', '')}"] = f"not run: {r['vllm']['error']}" if "error" in r["vllm"] \
            else r["vllm"]
    table(("engine", 18), [("out tok/s", 11, ".1f"), ("TTFT mean s", 13, ".2f"), ("TTFT p50 s", 12, ".2f"),
                           ("prompt tok", 12, ",d"), ("load s", 8, ".0f")],
          {k: v if isinstance(v, str) else [v["output_tokens_per_s"], v["ttft"]["mean_s"], v["ttft"]["p50_s"],
                                            v["prompt_tokens"], v["load_s"]] for k, v in rows.items()})
    lookups = mm["encoder_calls"] + mm["encoder_hits"]
    print(f"nanopaged's encoder: {mm['encoder_calls']} calls for {s['distinct_images']} distinct images, "
          f"{mm['encoder_hits']} cache hits ({mm['encoder_hits'] / max(lookups, 1):.0%} of lookups), "
          f"{mm['encoder_seconds']:.1f} s encoding; TTFT: from the call's start (all requests at once)")
    for name, t in r["targets"].items():
        print(f"target {name}: {t['value']:.3g} {verdict(t['met'])}")


def print_lora(r: dict) -> None:
    s = r["settings"]
    print(f"\nLoRA adapters mixed in one batch: {trace_line(s)}, greedy; rank {s['rank']} on all seven "
          f"projections; faster of two alternating runs; {host(r['machine'])}")
    table(("run", 14), [("wall s", 8, ".2f"), ("out tok/s", 11, ".1f"), ("of base", 9, ".0%"),
                        ("mean active", 13, ".1f")],
          {name: [run["wall_s"], run["output_tokens_per_s"], run["of_base"],
                  (run["stats"]["lora"] or {}).get("mean_active_adapters")] for name, run in r["runs"].items()})
    v = r.get("vllm")
    if v:
        print(f"vllm: {v['error']}" if "error" in v else
              f"vllm {v['version']} (CPU), the same adapters: 4 adapters {v['lora']['output_tokens_per_s']:.1f} "
              f"out tok/s, without adapters {v['base']['output_tokens_per_s']:.1f}")
    print(f"requests whose tokens the 4 adapters changed: {r['adapters_change_tokens']} of {s['num_requests']}")
    print("targets (issue 38): " + ", ".join(f"{name}: {t['value']:.2f} {verdict(t['met'])}"
                                             for name, t in r["targets"].items()))


def print_sharing(r: dict) -> None:
    print(f"\nKV memory saved by sharing ({r['settings']['num_prompts']} prompts per trace, "
          "prefix caching off; paper: vLLM, section 6.3, over widths 2-6)")
    table(("trace, kind, width", 26), [("saving", 9, ".1%"), ("mean blocks", 13, ".1f"), ("paper", 13, "")],
          {f"{x['trace']}, {x['kind']}, {x['width']}": [x["saving"], x["mean_blocks_used"], x["paper"]]
           for x in r["rows"]})


def print_structured(r: dict) -> None:
    print(f"\nstructured outputs: {trace_line(r['settings'])}, greedy; the same requests with and without a "
          "JSON schema (the faster of two runs each)")
    keys = ("wall_s", "output_tokens_per_s", "steps", "mask_s", "matcher_s", "mask_and_matcher_share",
            "median_step_share")
    table(("run", 13), [("wall s", 8, ".2f"), ("out tok/s", 11, ".1f"), ("steps", 7, ""), ("mask s", 9, ".3f"),
                        ("matcher s", 11, ".3f"), ("share", 8, ".1%"), ("median step", 13, ".1%")],
          {name: [r[name][k] for k in keys] for name in ("plain", "constrained")})
    print(f"the schema costs {r['overhead_per_token']:+.1%} per output token (target <= {r['target']:.0%}: "
          f"{verdict(r['target_met'])})")
    table(("compile", 14), [("cold ms", 10, ".2f"), ("cached ms", 11, ".4f")],
          {name: [t["cold_s"] * 1e3, t["cached_s"] * 1e3] for name, t in r["compile"].items()})


# ==== --workload spec ====================================================================

SPEC_COLUMNS = [("out tok/s", 10, ".1f"), ("x off", 8, ".2f"), ("acc len", 9, ".2f"), ("acc rate", 9, ".1%"),
                ("= off", 7, "")]
SPEC_KEY = ("  x off: output tokens/s over off's; acc len: mean acceptance length, tokens a verify step emits "
            "(1 + accepted / drafts); acc rate: drafts accepted / drafts; = off: greedy outputs equal to off's")


def spec_row(y: dict) -> list:
    same = f"{y['identical_to_off']}/{y['num_requests']}" if "identical_to_off" in y else None
    return [y["output_tokens_per_s"], y.get("speedup_vs_off"), y["mean_acceptance_length"],
            y["draft_acceptance_rate"], same]


def config_rows(configs: dict, row) -> dict:
    """label -> row(config), or why it failed."""
    return {x["label"]: f"failed: {x['error']}" if "error" in x else row(x) for x in configs.values()}


def print_spec(r: dict) -> None:
    s = r["settings"]
    print(f"\nspeculative decoding: model {Path(s['model']).name}, {s['threads']} torch threads, greedy; "
          f"n-gram prompt_lookup_max {s['prompt_lookup_max']}, min {s['prompt_lookup_min']}; suffix: vLLM's defaults, "
          f"k as given; draft model: {s['draft_note']}; drafts per step: {s['draft_policy']}")
    for section, show in (("repeating", print_repeating), ("agent", print_agent), ("json", print_json),
                          ("trace", print_trace)):
        if section in r:
            show(r)
    print()
    for t in r["targets"].values():
        value = "not run" if t["value"] is None else f"{t['value']:.2f}x ({t['of']})"
        print(f"target: {t['what']} >= {t['target']}x: {value}: {verdict(t['met'])}")
    if "vllm" in r.get("peers", {}):
        print_vllm(r["peers"]["vllm"])


def print_repeating(r: dict) -> None:
    s, rep = r["settings"], r["repeating"]
    max_tokens = s["max_tokens"] or f"passage tokens + {s['max_tokens_slack']}"
    kinds = {}
    for p in r["prompts"]:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    print(f"\nrepeating: {s['num_prompts']} chat prompts ({', '.join(f'{v} {k}' for k, v in kinds.items())}) over "
          f"passages of {r['passage_tokens'][0]}-{r['passage_tokens'][1]} tokens of {', '.join(s['texts'])}; stops "
          f"at EOS, max_tokens {max_tokens}; "
          "prefix caching off\n")
    table(("one request at a time", 26), SPEC_COLUMNS,
          config_rows(rep["configs"], lambda x: spec_row(x["concurrency"]["1"])))
    print(SPEC_KEY)
    levels = [str(c) for c in rep["concurrency"] if c > 1]
    if levels:
        print()
        table(("out tok/s at once", 26), [col for c in levels for col in ((f"{c} at once", 11, ".1f"),
                                                                          ("x off", 7, ".2f"))],
              config_rows(rep["configs"], lambda x: [v for c in levels for v in (
                  x["concurrency"][c]["output_tokens_per_s"], x["concurrency"][c].get("speedup_vs_off"))]))
        print(f"  drafts per step: {s['draft_policy']}")
    for x in rep["configs"].values():
        diffs = {c: y["first_differences"] for c, y in x.get("concurrency", {}).items() if y.get("first_differences")}
        if diffs:
            print(f"  {x['label']}: outputs that differ from off's first differ at output token "
                  + "; ".join(f"{c} at once: {', '.join(map(str, d))}" for c, d in diffs.items()))
    if "copies" in rep:
        same = ", ".join(f"{c} at once {v}/{s['num_prompts']}"
                         for c, v in rep["off_batched_identical_to_one_at_a_time"].items() if c != "1")
        print(f"  off's answers equal to the passage: {', '.join(f'{k} {v}' for k, v in rep['copies'].items())} "
              f"(of {', '.join(f'{v} {k}' for k, v in kinds.items())}); off = off one at a time: {same or '-'}")


def print_agent(r: dict) -> None:
    a = r["agent"]
    s = a["settings"]
    print(f"\nagent: one tool call asked {s['num_prompts']} times with another city, date and unit, one request at a "
          f"time in order on one engine; prompts {s['prompt_tokens'][0]}-{s['prompt_tokens'][1]} tokens (system "
          f"prompt, tool schema, one worked exchange), answers as taught {s['expected_answer_tokens'][0]}-"
          f"{s['expected_answer_tokens'][1]} tokens, max_tokens {s['max_tokens']}; prefix caching on")
    table(("configuration", 26), SPEC_COLUMNS + [("first req", 11, ".1f"), ("the rest", 10, ".1f")],
          config_rows(a["configs"], lambda x: spec_row(x["concurrency"]["1"]) + [
              x["first_and_rest"]["first_tokens_per_s"], x["first_and_rest"]["rest_tokens_per_s"]]))
    print("  first req / the rest: out tok/s of the first request (nothing learned yet) and of the others")
    if "answers_as_taught" in a:
        print(f"  off's answers equal to the one the worked exchange teaches: {a['answers_as_taught']}/"
              f"{s['num_prompts']}")


def print_json(r: dict) -> None:
    j = r["json"]
    s = j["settings"]
    levels = [str(c) for c in s["concurrency"]]
    print(f"\njson: the agent's tool call under its JSON schema (fixed keys, two enums, a date pattern, no "
          f"whitespace), {s['num_prompts']} requests, max_tokens {s['max_tokens']}; forced drafts: "
          f"{s['forced_drafts']}")
    table(("configuration", 36),
          [col for c in levels for col in (("one at a time" if c == "1" else f"{c} at once", 15, ".1f"),
                                           ("x off", 7, ".2f"), ("acc len", 9, ".2f"))],
          config_rows(j["configs"], lambda x: [v for c in levels for v in (
              x["concurrency"][c]["output_tokens_per_s"], x["concurrency"][c].get("speedup_vs_off"),
              x["concurrency"][c]["mean_acceptance_length"])]))
    for key, where in (("forced_vs_without", "one at a time"), ("forced_vs_without_at_once", "all at once")):
        value, of = j[key]
        if value is not None:
            print(f"  with forced drafts over without, {where}: {value:.2f}x ({of})")
    if "valid_calls" in j:
        print(f"  off's outputs that call the tool with the request's city, date and unit: "
              f"{j['valid_calls']}/{s['num_prompts']}")


def print_trace(r: dict) -> None:
    t = r["trace"]
    ts = t["settings"]
    print(f"\nrandom-token trace (the throughput workload's: {trace_line(ts)}, greedy, ignore_eos)")

    def row(x: dict) -> list:
        spec = x.get("spec_decode") or {}
        same = f"{x['identical_to_off']}/{ts['num_requests']}" if "identical_to_off" in x else None
        return [x["output_tokens_per_s"], x.get("speedup_vs_off"), spec.get("mean_acceptance_length"),
                spec.get("draft_acceptance_rate"), same, spec.get("num_drafts"), x.get("cost")]
    names = ("off", f"ngram_k{ts['ngram_k']}", f"suffix_k{ts['suffix_k']}")
    table(("configuration", 14), SPEC_COLUMNS + [("drafts", 8, ""), ("cost", 8, "+.1%")],
          {name: f"failed: {t[name]['error']}" if "error" in t[name] else row(t[name]) for name in names})
    print("  drafts: drafting steps; cost: 1 - x off (negative: drafts found in the model's own output)")


def print_vllm(v: dict) -> None:
    print("\nvLLM (its own environment, the same prompts and token ids, its own n-gram and suffix speculation; one "
          "engine for every concurrency, so its suffix cache holds the answers of the concurrencies before: "
          "optimistic past 1)")
    if "skipped" in v:
        print(f"  not run: {v['skipped']}")
        return
    rows = {}
    for name, x in v.items():
        if "skipped" in x:
            rows[name] = f"not run: {x['skipped']}"
            continue
        runs = {**{("one at a time" if c == "1" else f"{c} at once"): y for c, y in x["concurrency"].items()},
                **({"agent": x["agent"]} if "agent" in x else {})}
        for label, y in runs.items():
            accepted = (y.get("spec_decode") or {}).get("mean_acceptance_length")
            rows[f"{name}, {label}"] = [x["version"], y["output_tokens_per_s"], y.get("speedup_vs_off"),
                                        y.get("identical_to_off"), accepted]
    table(("run", 30), [("vllm", 10, ""), ("out tok/s", 11, ".1f"), ("x off", 7, ".2f"), ("= off", 7, ""),
                        ("acc len", 9, ".2f")], rows)


# ==== --workload moe, serve, ray ========================================================

def print_moe(r: dict) -> None:
    s, e, f = r["settings"], r["engine"], r["floor"]
    print(f"\nmixture of experts: {s['random_weights']} (random weights), {trace_line(s)}, {s['threads']} threads; "
          f"{host(r['machine'])}")
    print(f"  nanopaged ({e['stats']['cpu_linear']}, {e['stats']['cpu_kernels']}, quantization "
          f"{(e['quantization'] or {}).get('quantization')}): trace {e['output_tokens_per_s']:.1f} tok/s, one "
          f"request {e['decode_tokens_per_s']:.2f} tok/s, loaded in {e['load_s']:.0f} s; busiest expert "
          f"{e['expert_load']:.2f}x the mean")
    print(f"  active-weight floor: {f['active_weight_bytes'] / 1e9:.2f} GB a token at "
          f"{f['read_bytes_per_s'] / 1e9:.1f} GB/s read (a copy: {f['copy_bytes_per_s'] / 1e9:.1f} GB/s) = "
          f"{f['decode_tokens_per_s']:.2f} tok/s; one request at {f['fraction']:.0%} of it")
    v = r.get("vllm")
    if v:
        print(f"  vLLM CPU: {v['error']}" if "error" in v else
              f"  vLLM CPU {v['version']}: trace {v['output_tokens_per_s']:.1f} tok/s, one request "
              f"{v['decode_tokens_per_s'] or 0:.2f} tok/s, loaded in {v['load_s']:.0f} s")
    for name, t in r["targets"].items():
        print(f"  target {name}: {t['value']:.2f} {'MET' if t['met'] else 'MISSED'}")


def print_serve(result: dict) -> None:
    s = result["settings"]
    chat = f" (chat: after a shared {s['system_prompt_words']}-word system prompt)" if "chat" in s["datasets"] else ""
    print(f"\nserve: {s['num_requests']} streamed requests per rate, Poisson arrivals at {', '.join(s['rates'])}/s, "
          f"prompts {s['input_len_words'][0]}-{s['input_len_words'][1]} words{chat}, "
          f"max_tokens {s['output_len'][0]}-{s['output_len'][1]}, greedy; model {s['model']}, {s['device']} "
          f"{s['dtype']}")
    for name, r in result["servers"].items():
        if "skipped" in r:
            print(f"{name} skipped: {r['skipped']}")
        elif r["server"].get("cpu_binding"):
            print(f"{name} {r['server'].get('version') or ''}: {', '.join(r['server']['cpu_binding'])}")
    for d in s["datasets"]:
        print(f"\n{d}:")
        rows = {}
        for name, r in result["servers"].items():
            for rate, f in r.get("datasets", {}).get(d, {}).items():
                rows[f"{name} {rate}"] = [f["completed"], f["requests_per_s"], f["output_tokens_per_s"],
                                          p50_p99(f, "ttft", ".0f"), p50_p99(f, "tpot", ".1f"),
                                          p50_p99(f, "itl", ".1f"), f.get("prefix_hit_rate")]
                if f["failed"]:
                    rows[f"  {f['failed']} of {name}'s failed:"] = str(f["errors"])
        table(("server rate", 27), [("done", 6, ""), ("req/s", 7, ".2f"), ("out tok/s", 10, ".1f"),
                                    ("TTFT p50/p99 ms", 17, ""), ("TPOT p50/p99 ms", 17, ""),
                                    ("ITL p50/p99 ms", 16, ""), ("hits", 6, ".0%")], rows)
        for peer, n in result["same_text"].get(d, {}).items():
            print(f"greedy answers identical to nanopaged's: {peer} {n['identical']} of {n['of']}")
        print(f"targets (issue 40), {d}: " + "; ".join(describe_target(t) for t in result["targets"][d].values()))
        print_data_parallel(result["servers"], d)


def p50_p99(f: dict, key: str, fmt: str) -> str:
    return "/".join(format(f[f"{key}_ms_{p}"], fmt) for p in ("p50", "p99"))


def print_data_parallel(servers: dict, d: str) -> None:
    """Issue 55's targets, where dp2 servers ran: all at once, out tok/s at least one core's (DP=1, both
    threads); prefix-aware routing's hit rate within 5 points of one core's (round-robin's reported)."""
    one = servers.get("nanopaged", {}).get("datasets", {}).get(d, {}).get("inf")
    for name, r in servers.items():
        f = r.get("datasets", {}).get(d, {}).get("inf")
        if not name.startswith("dp2-") or f is None or one is None or not one["output_tokens_per_s"]:
            continue
        ratio = f["output_tokens_per_s"] / one["output_tokens_per_s"]
        line = f"{name} all at once: {ratio:.2f}x one engine core's out tok/s (>= 1): {verdict(ratio >= 1)}"
        if f.get("prefix_hit_rate") is not None and one.get("prefix_hit_rate") is not None:
            gap = one["prefix_hit_rate"] - f["prefix_hit_rate"]
            line += f"; hit rate {f['prefix_hit_rate']:.0%} against {one['prefix_hit_rate']:.0%}"
            line += f" (prefix-aware within 5 points: {verdict(gap <= 0.05)})" if "prefix" in name else ""
        print(line)


def describe_target(t: dict) -> str:
    if t["status"] in ("met", "missed") and "rate" in t:
        return (f"p99 TTFT at {t['rate']}/s, where vllm's is {t['vllm']:.0f} ms: {t['value']:.0f} ms "
                f"(< {SERVE_TARGETS['ttft_p99_ms']:.0f}): {t['status']}")
    if t["status"] in ("met", "missed"):
        return (f"all at once {t['value']:.2f}x vllm's out tok/s ({t['nanopaged']:.1f} vs {t['vllm']:.1f}; "
                f">= {SERVE_TARGETS['saturated_vs_vllm']}x): {t['status']}")
    return f"{t['target']}: {t['status']}" + (f" ({t['why']})" if "why" in t else "")


def print_ray(result: dict) -> None:
    m = result["machine"]
    print(f"\nRay Data: {result['rows']} rows, input {result['input_len']}, output {result['output_len']} tokens, "
          f"dtype {result['dtype']}, batch_size {result['batch_size']} x {result['max_concurrent_batches']} in "
          f"flight; {m['cpu_cores']} cores, {host(m)}")
    keys = ("rows_per_s", "output_tokens_per_s", "generation_s", "wall_s", "overhead_vs_generate",
            "same_tokens_as_generate")
    table(("run", 14), [("rows/s", 9, ".2f"), ("out tok/s", 11, ".1f"), ("gen s", 8, ".1f"), ("wall s", 8, ".1f"),
                        ("vs generate", 13, "+.0%"), ("same tokens", 13, "")],
          {r["run"]: [r[k] for k in keys] for r in result["runs"]})
