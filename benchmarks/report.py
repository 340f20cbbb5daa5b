"""What every workload prints, in one place: the throughput table and the plot, then each other
workload's tables (spec, moe, serve, ray among them) and the tensor-parallel research tool's, each
from the figures its run returns."""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.figures import SERVE_TARGETS


def table(head: tuple[str, int], columns: list[tuple[str, int, str]], rows: dict) -> None:
    """The tables' one shape: a header line, then a line per row, its name left-aligned in head's width,
    then each value right-aligned in its column's width and format ("-" for None)."""
    print(f"{head[0]:<{head[1]}}" + "".join(f"{h:>{w}}" for h, w, _ in columns))
    for name, values in rows.items():
        print(f"{name:<{head[1]}}" + "".join(f"{'-' if v is None else format(v, f):>{w}}"
                                              for (_, w, f), v in zip(columns, values)))


def host(m: dict) -> str:
    return f"{m['cpu']}, flags {' '.join(m['matrix_flags']) or 'none'}"


def print_table(r: dict) -> None:
    s, e = r["settings"], r["engine"]
    print(f"\n{s['num_requests']} requests, input {s['input_len'][0]}-{s['input_len'][1]}, "
          f"output {s['output_len'][0]}-{s['output_len'][1]} tokens, seed {s['seed']}, "
          f"model {Path(s['model']).name}, {r['machine']['cpu']} ({r['machine']['cpu_cores']} cores, "
          f"{s['threads']} torch threads)")
    mach = r["machine"]
    print(f"{s['dtype']}, cpu_linear {s['cpu_linear']}, cpu_kernels {s.get('cpu_kernels')}, attention "
          f"{s.get('attention_backend')}, batch-invariant {s.get('batch_invariant')}, quantization "
          f"{s.get('quantization')}; CPU flags {' '.join(mach['matrix_flags']) or 'none'} "
          f"(bfloat16 matrix units: {', '.join(mach['bf16_matrix_units']) or 'none'})")
    print(f"\n{'engine (measured, this run)':30} {'out tok/s':>10} {'total tok/s':>12} {'req/s':>7} "
          f"{'wall s':>8} {'vs nanopaged':>13}")
    rows = {"nanopaged": e, **r["peers"]}
    for name, f in rows.items():
        if "skipped" in f:
            print(f"{name:30} not run: {f['skipped']}")
            continue
        rel = e["output_tokens_per_s"] / f["output_tokens_per_s"]
        print(f"{name:30} {f['output_tokens_per_s']:10.1f} {f['total_tokens_per_s']:12.1f} "
              f"{f['requests_per_s']:7.2f} {f['wall_s']:8.2f} {rel:12.2f}x")
    if "dense" in r:
        d = r["dense"]
        print(f"  nanopaged with and without quantization, alternating on the same trace, best of "
              f"{len(d['runs']['quantized'])} and {len(d['runs']['dense'])}: {d['quantized_output_tokens_per_s']:.1f} and "
              f"{d['output_tokens_per_s']:.1f} out tok/s (quantized / dense {d['ratio']:.2f}x)")
    b = r.get("batch_invariance", {})
    if b.get("same_kernels"):
        print(f"  batch-invariant: the same kernels with and without it here ({', '.join(b['kernels'])}): no cost")
    elif b.get("batch_invariant"):
        print(f"  batch-invariant ({', '.join(b['kernels'])}) and not ({', '.join(b['kernels_off'])}), alternating on "
              f"the same trace, best of 2 each: {b['invariant_output_tokens_per_s']:.1f} and "
              f"{b['output_tokens_per_s']:.1f} out tok/s ({b['ratio']:.2f}x); one request at a time "
              f"{b['single_stream_ratio']:.2f}x")
    if "one_request_at_a_time" in r["peers"].get("llama.cpp", {}):
        print(f"  llama.cpp {r['peers']['llama.cpp']['version']} on {r['peers']['llama.cpp']['gguf']}, one request at a "
              "time (its Python API serves no batches)")
    c = r["peers"].get("ctranslate2", {})
    if "compute_type" in c:
        sweep = ", ".join(f"{t}: {v:.1f}" for t, v in c["sweep"].items())
        print(f"  ctranslate2 {c['version']} at compute type {c['compute_type']} (out tok/s by type: {sweep}; the CPU "
              f"supports {', '.join(c['supported_compute_types'])}), {c['num_calls']} generate_batch call(s) of at "
              f"most {c['max_batch_size']} requests, each row ended at its own length")
    v = r["peers"].get("vllm", {})
    if "identical_outputs" in v:
        print(f"  vllm {v['version']} in its own environment (loaded in {v['load_s']:.0f} s, the same KV bytes); "
              f"greedy outputs identical to nanopaged's on {v['identical_outputs']} of {s['num_requests']} requests")
    if "hf" in r["peers"] and "padding_waste" in r["peers"]["hf"]:
        hf = r["peers"]["hf"]
        sweep = ", ".join(f"{b}: {v:.1f}" for b, v in hf["sweep"].items())
        print(f"  hf at its fastest static batch size, {hf['batch_size']} (out tok/s by size: {sweep}); "
              f"{hf['padding_waste']:.1%} of the token slots computed were padding")
    pub = r["published"]
    print(f"\npublished, NOT measured here ({pub['setup']}):")
    for name, v in pub["output_tokens_per_s"].items():
        print(f"  {name:28} {v:10.2f} out tok/s")

    k, m = r["kv_utilization"], r["memory"]
    print("\nKV utilization (tokens stored / slots held, every step):")
    print(f"  paged (nanopaged)             {k['paged']:7.1%}")
    print(f"  reserve prompt + max_tokens   {k['reserve_prompt_plus_max_tokens']:7.1%}")
    print(f"  reserve max_model_len         {k['reserve_max_model_len']:7.1%}   "
          f"(max_model_len {s['max_model_len']})")
    if "hf" in r["peers"] and "kv_utilization" in r["peers"]["hf"]:
        print(f"  hf static padded cache        {r['peers']['hf']['kv_utilization']:7.1%}")
    mr = m["max_num_running"]
    print(f"  most requests at once, {m['kv_budget_tokens']} KV slots: paged {mr['paged']} "
          f"(bound by {mr['paged_bound_by']}), reserve prompt+max {mr['reserve_prompt_plus_max_tokens']}, "
          f"reserve max_model_len {mr['reserve_max_model_len']}")
    hit = m["prefix_cache_hit_rate"]
    print(f"  preemptions {m['num_preemptions']}, KV usage peak {m['peak_kv_usage']:.1%} "
          f"mean {m['mean_kv_usage']:.1%}, prefix hit rate "
          f"{'n/a (no lookups)' if hit is None else f'{hit:.1%}'}")

    o, rf = r["overhead"], r["roofline"]
    print(f"\nengine step: {o['step_ms']:.1f} ms = scheduler+block pool {o['schedule_ms_per_step']:.2f} ms "
          f"({o['schedule_share']:.1%}) + model {o['model_ms_per_step']:.1f} ms; "
          f"outside step(): {o['other_share_of_wall']:.1%} of wall")
    print(f"roofline: {rf['kernel']} {rf['kernel_flops_per_s'] / 1e9:.1f} GFLOP/s, {rf['flops_per_token'] / 1e6:.0f} "
          f"MFLOP/token -> {rf['roofline_tokens_per_s']:.0f} tok/s; nanopaged reaches {rf['fraction']:.1%}")

    fl = rf["floor"]
    print(f"trace floor: {fl['seconds']:.2f} s for nanopaged's {fl['num_steps']} steps ({fl['weight_bound_steps']} bound by "
          f"streaming {fl['weight_bytes'] / 1e6:.0f} MB of weights as stored and {fl['kv_bytes_per_token']:,} bytes of "
          f"K/V per token of context at a read's {fl['read_bytes_per_s'] / 1e9:.1f} GB/s, the rest by arithmetic at "
          f"{rf['kernel']}'s measured {fl['kernel_flops_per_s'] / 1e9:.1f} GFLOP/s); nanopaged's wall "
          f"{fl['wall_s']:.2f} s reaches {fl['fraction']:.1%} of it")
    table(("step kind", 14), [("steps", 7, ""), ("model s", 9, ".2f"), ("floor s", 9, ".2f"), ("floor/model", 13, ".1%"),
                              ("bound by", 12, ""), ("own matmuls s", 15, ".2f")],
          {k: [v["num_steps"], v["model_s"], v["floor_s"], v["share"], v["bound_by"], v["own_matmuls_s"]]
           for k, v in fl["by_step_kind"].items()})
    ss = r["single_stream"]
    print(f"one request at a time ({ss['prompt_tokens']}-token prompt, {ss['output_tokens']} tokens): decode "
          f"nanopaged {ss['nanopaged_decode_tokens_per_s']:.1f} tok/s, hf generate "
          f"{ss['hf_decode_tokens_per_s']:.1f} tok/s ({ss['ratio']:.2f}x)"
          + "".join(f", {name} {ss[f'{key}_decode_tokens_per_s']:.1f} tok/s ({ss[f'ratio_vs_{key}']:.2f}x)"
                    for name, key in (("vllm", "vllm"), ("llama.cpp", "llamacpp")) if f"{key}_decode_tokens_per_s" in ss))
    if "quality" in r:
        q = r["quality"]
        print(f"perplexity of {q['text_tokens']} tokens of English: "
              + ", ".join(f"{k} {v:.3f}" for k, v in q["perplexity"].items()))
    if "noise" in r:
        n = r["noise"]
        for name in ("nanopaged", "hf"):
            if name in n:
                k = n[name]
                print(f"beside a busy core ({n['neighbour_core']}): {name} keeps {k['kept']:.1%} of its quiet "
                      f"output tokens/s ({k['noisy_output_tokens_per_s']:.1f} of {k['quiet_output_tokens_per_s']:.1f})")

    print("\ntargets:")
    for name, t in r["targets"].items():
        sign, verdict = "<=" if t["lower_is_better"] else ">=", "met" if t["met"] else "MISSED"
        print(f"  {name:22} " + ("n/a" if t["value"] is None else f"{t['value']:8.3f}  target {sign} {t['target']}  {verdict}"))


def plot(r: dict, samples: list, path: str) -> None:
    try:
        import matplotlib
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


def print_shared_prefix(r: dict) -> None:
    s = r["settings"]
    print(f"\nshared prefix: {s['num_requests']} requests = {s['prefix_len']}-token system prompt + "
          f"{s['question_len'][0]}-{s['question_len'][1]}-token question, output {s['output_len'][0]}-"
          f"{s['output_len'][1]} tokens; {r['prompt_tokens']} prompt tokens, shared fraction "
          f"{r['shared_fraction']:.1%}")
    table(("prefix caching", 16), [("wall s", 9, ".2f"), ("prefill tokens", 16, ""), ("hit rate", 10, ".1%"),
                                   ("out tok/s", 11, ".1f")],
          {k: [r[k][x] for x in ("wall_s", "prefill_tokens_computed", "hit_rate", "output_tokens_per_s")]
           for k in ("on", "off")})
    print(f"prefill tokens computed fall by {r['prefill_reduction']:.1%} (shared fraction "
          f"{r['shared_fraction']:.1%}); speedup {r['speedup']:.2f}x (target 2x); "
          f"outputs identical: {r['identical_outputs']}")


def print_cascade(r: dict) -> None:
    s, m = r["settings"], r["machine"]
    print(f"\nshared prefixes read once: decode steps (model + sampler, best of {s['rounds']} rounds), "
          f"{s['prefix_len']}-token prefix, {s['output_len']} tokens out; {host(m)}")
    table(("workload", 16), [("rows", 6, ""), ("read once ms", 14, ".1f"), ("plain ms", 10, ".1f"),
                             ("own copies ms", 15, ".1f"), ("speedup", 9, ""), ("same tokens", 13, "")],
          {name: [w["rows"], *(w["decode_step_ms"].get(k) for k in ("read once", "plain", "own copies")),
                  f"{w['speedup']:.2f}x", str(w["identical_outputs"])] for name, w in r["workloads"].items()})
    print("target: decode steps >= 1.5x faster read once than plain (issue 37): " + ", ".join(
        f"{name} {'met' if w['speedup'] >= 1.5 else 'missed'}" for name, w in r["workloads"].items()))


def print_overlap(r: dict) -> None:
    s, m = r["settings"], r["machine"]
    print(f"\nasync scheduling off vs on (fastest of {s['rounds']} rounds each; ms per step by phase; busy: the "
          f"share of the steps' wall time the forward pass ran); {host(m)}")
    rows = {}
    for name, w in r["workloads"].items():
        for mode in ("off", "on"):
            f = w[mode]
            rows[f"{name}, {mode}"] = [f["output_tokens_per_s"], f["step_wall_ms"],
                                       *(f["step_ms"].get(p) for p in PHASES), f["model_busy_share"]]
    table(("workload", 24), [("out tok/s", 11, ".1f"), ("step ms", 9, ".2f"),
                             *((p, 9, ".2f") for p in PHASES), ("busy", 7, ".1%")], rows)
    for name, w in r["workloads"].items():
        on, gain = w["on"]["model_busy_share"], w["speedup"] - 1
        print(f"{name}: same tokens {w['identical_outputs']}; targets (issue 54): busy >= 97% with it on "
              f"{on:.1%} {'met' if on >= 0.97 else 'missed'}; out tok/s +{gain:.1%} against the non-model share "
              f"off {w['non_model_share_off']:.1%}: {'met' if gain >= w['non_model_share_off'] else 'missed'}")


PHASES = ("schedule", "prepare", "forward", "wait", "sample", "update", "output")


def print_lora(r: dict) -> None:
    s, m = r["settings"], r["machine"]
    print(f"\nLoRA adapters mixed in one batch: {s['num_requests']} requests, prompts {s['input_len'][0]}-"
          f"{s['input_len'][1]}, outputs {s['output_len'][0]}-{s['output_len'][1]} tokens, greedy; rank {s['rank']} "
          f"on all seven projections; faster of two alternating runs; {host(m)}")
    table(("run", 14), [("wall s", 8, ".2f"), ("out tok/s", 11, ".1f"), ("of base", 9, ".0%"),
                        ("mean active", 13, ".1f")],
          {name: [run["wall_s"], run["output_tokens_per_s"], run["of_base"],
                  (run["stats"]["lora"] or {}).get("mean_active_adapters")] for name, run in r["runs"].items()})
    v = r.get("vllm")
    if v and "error" in v:
        print(f"vllm: {v['error']}")
    elif v:
        print(f"vllm {v['version']} (CPU), the same adapters: 4 adapters {v['lora']['output_tokens_per_s']:.1f} out "
              f"tok/s, without adapters {v['base']['output_tokens_per_s']:.1f}")
    print(f"requests whose tokens the 4 adapters changed: {r['adapters_change_tokens']} of {s['num_requests']}")
    print("targets (issue 38): " + ", ".join(f"{name}: {t['value']:.2f} {'met' if t['met'] else 'missed'}"
                                             for name, t in r["targets"].items()))


def print_sharing(r: dict) -> None:
    print(f"\nKV memory saved by sharing ({r['settings']['num_prompts']} prompts per trace, "
          "prefix caching off; paper: vLLM, section 6.3, over widths 2-6)")
    print(f"{'trace':<15}{'kind':<10}{'width':>6}{'saving':>9}{'mean blocks':>13}{'paper':>13}")
    for row in r["rows"]:
        print(f"{row['trace']:<15}{row['kind']:<10}{row['width']:>6}{row['saving']:>9.1%}"
              f"{row['mean_blocks_used']:>13.1f}{row['paper']:>13}")


def print_structured(r: dict) -> None:
    s = r["settings"]
    print(f"\nstructured outputs: {s['num_requests']} requests, prompts {s['input_len'][0]}-{s['input_len'][1]} "
          f"tokens, outputs {s['output_len'][0]}-{s['output_len'][1]} tokens, greedy; the same requests with "
          "and without a JSON schema (the faster of two runs each)")
    keys = ("wall_s", "output_tokens_per_s", "steps", "mask_s", "matcher_s", "mask_and_matcher_share",
            "median_step_share")
    table(("run", 13), [("wall s", 8, ".2f"), ("out tok/s", 11, ".1f"), ("steps", 7, ""), ("mask s", 9, ".3f"),
                        ("matcher s", 11, ".3f"), ("share", 8, ".1%"), ("median step", 13, ".1%")],
          {name: [r[name][k] for k in keys] for name in ("plain", "constrained")})
    verdict = "met" if r["target_met"] else "missed"
    print(f"the schema costs {r['overhead_per_token']:+.1%} per output token (target <= {r['target']:.0%}: {verdict})")
    table(("compile", 14), [("cold ms", 10, ".2f"), ("cached ms", 11, ".4f")],
          {name: [t["cold_s"] * 1e3, t["cached_s"] * 1e3] for name, t in r["compile"].items()})


# ==== --workload spec ====================================================================

SAME = ("  acc len: mean acceptance length, tokens a verify step emits (1 + accepted / drafts); acc rate: drafts "
        "accepted / drafts; = off: greedy outputs equal to off's token for token")


def _f(x, fmt: str, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}{fmt}}"


def _row(y: dict) -> str:
    """out tok/s, speedup, acc len, acc rate, = off of one run."""
    same = f"{y['identical_to_off']}/{y['num_requests']}" if "identical_to_off" in y else "-"
    return (f"{y['output_tokens_per_s']:>10.1f}{_f(y.get('speedup_vs_off'), '.2f', 8)}x"
            f"{_f(y['mean_acceptance_length'], '.2f', 9)}{_f(y['draft_acceptance_rate'], '.1%', 9)}{same:>7}")


HEAD = f"{'out tok/s':>10}{'speedup':>9}{'acc len':>9}{'acc rate':>9}{'= off':>7}"


def print_spec(r: dict) -> None:
    s = r["settings"]
    print(f"\nspeculative decoding: model {Path(s['model']).name}, {s['threads']} torch threads, greedy; "
          f"n-gram prompt_lookup_max {s['prompt_lookup_max']}, min {s['prompt_lookup_min']}; suffix: vLLM's defaults, "
          f"k as given; draft model: {s['draft_note']}; drafts per step: {s['draft_policy']}")
    if "repeating" in r:
        print_repeating(r)
    if "agent" in r:
        print_agent(r["agent"])
    if "json" in r:
        print_json(r["json"])
    if "trace" in r:
        print_trace(r["trace"])
    print()
    for t in r["targets"].values():
        value = "not run" if t["value"] is None else f"{t['value']:.2f}x ({t['of']})"
        print(f"target: {t['what']} >= {t['target']}x: {value}: {'met' if t['met'] else 'missed'}")
    v = r.get("peers", {}).get("vllm")
    if v is not None:
        print_vllm(v)


def print_repeating(r: dict) -> None:
    s, rep = r["settings"], r["repeating"]
    n = s["num_prompts"]
    max_tokens = s["max_tokens"] or f"passage tokens + {s['max_tokens_slack']}"
    kinds = {}
    for p in r["prompts"]:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    print(f"\nrepeating: {n} chat prompts ({', '.join(f'{v} {k}' for k, v in kinds.items())}) over passages of "
          f"{r['passage_tokens'][0]}-{r['passage_tokens'][1]} tokens of {', '.join(s['texts'])}; stops at EOS, "
          f"max_tokens {max_tokens}; prefix caching off")
    print(f"\n{'one request at a time':26}{HEAD}")
    for x in rep["configs"].values():
        print(f"{x['label']:26}" + (f" failed: {x['error']}" if "error" in x else _row(x["concurrency"]["1"])))
    print(SAME)
    levels = [c for c in rep["concurrency"] if c > 1]
    if levels:
        print(f"\n{'at once: out tok/s (x off)':26}" + "".join(f"{f'{c} at once':>18}" for c in levels))
        for x in rep["configs"].values():
            if "error" not in x:
                print(f"{x['label']:26}" + "".join(
                    f"{x['concurrency'][str(c)]['output_tokens_per_s']:>10.1f} ("
                    f"{_f(x['concurrency'][str(c)].get('speedup_vs_off'), '.2f', 4)}x)" for c in levels))
        print(f"  drafts per step: {s['draft_policy']}")
    for x in rep["configs"].values():
        diffs = {c: y["first_differences"] for c, y in x.get("concurrency", {}).items() if y.get("first_differences")}
        if diffs:
            print(f"  {x['label']}: outputs that differ from off's first differ at output token "
                  + "; ".join(f"{c} at once: {', '.join(map(str, d))}" for c, d in diffs.items()))
    if "copies" in rep:
        same = ", ".join(f"{c} at once {v}/{n}" for c, v in rep["off_batched_identical_to_one_at_a_time"].items()
                         if c != "1")
        print(f"  off's answers equal to the passage: {', '.join(f'{k} {v}' for k, v in rep['copies'].items())} "
              f"(of {', '.join(f'{v} {k}' for k, v in kinds.items())}); off = off one at a time: {same or '-'}")


def print_agent(a: dict) -> None:
    s = a["settings"]
    print(f"\nagent: one tool call asked {s['num_prompts']} times with another city, date and unit, one request at a "
          f"time in order on one engine; prompts {s['prompt_tokens'][0]}-{s['prompt_tokens'][1]} tokens (system "
          f"prompt, tool schema, one worked exchange), answers as taught {s['expected_answer_tokens'][0]}-"
          f"{s['expected_answer_tokens'][1]} tokens, max_tokens {s['max_tokens']}; prefix caching on")
    print(f"{'configuration':26}{HEAD}{'first req':>11}{'the rest':>10}")
    for x in a["configs"].values():
        if "error" in x:
            print(f"{x['label']:26} failed: {x['error']}")
            continue
        fr = x["first_and_rest"]
        print(f"{x['label']:26}{_row(x['concurrency']['1'])}{fr['first_tokens_per_s']:>11.1f}"
              f"{_f(fr['rest_tokens_per_s'], '.1f', 10)}")
    print("  first req / the rest: out tok/s of the first request (nothing learned yet) and of the others")
    if "answers_as_taught" in a:
        print(f"  off's answers equal to the one the worked exchange teaches: {a['answers_as_taught']}/"
              f"{s['num_prompts']}")


def print_json(j: dict) -> None:
    s = j["settings"]
    levels = s["concurrency"]
    print(f"\njson: the agent's tool call under its JSON schema (fixed keys, two enums, a date pattern, no "
          f"whitespace), {s['num_prompts']} requests, max_tokens {s['max_tokens']}; forced drafts: "
          f"{s['forced_drafts']}")
    print(f"{'configuration':36}" + "".join(f"{('one at a time' if c == 1 else f'{c} at once'):>28}" for c in levels))
    for x in j["configs"].values():
        if "error" in x:
            print(f"{x['label']:36} failed: {x['error']}")
            continue
        line = f"{x['label']:36}"
        for c in levels:
            y = x["concurrency"][str(c)]
            line += (f"{y['output_tokens_per_s']:>10.1f} tok/s {_f(y.get('speedup_vs_off'), '.2f', 5)}x "
                     f"len {_f(y['mean_acceptance_length'], '.2f', 4)}")
        print(line)
    for key, where in (("forced_vs_without", "one at a time"), ("forced_vs_without_at_once", "all at once")):
        value, of = j[key]
        if value is not None:
            print(f"  with forced drafts over without, {where}: {value:.2f}x ({of})")
    if "valid_calls" in j:
        print(f"  off's outputs that call the tool with the request's city, date and unit: "
              f"{j['valid_calls']}/{s['num_prompts']}")


def print_trace(t: dict) -> None:
    ts = t["settings"]
    print(f"\nrandom-token trace (the throughput workload's: {ts['num_requests']} requests, input {ts['input_len'][0]}-"
          f"{ts['input_len'][1]}, output {ts['output_len'][0]}-{ts['output_len'][1]} tokens, greedy, ignore_eos)")
    for name in ("off", f"ngram_k{ts['ngram_k']}", f"suffix_k{ts['suffix_k']}"):
        x = t[name]
        if "error" in x:
            print(f"  {name:12} failed: {x['error']}")
            continue
        spec, extra = x.get("spec_decode"), ""
        if spec and "speedup_vs_off" in x:
            drafted = (f"acceptance length {spec['mean_acceptance_length']:.2f}, rate "
                       f"{spec['draft_acceptance_rate']:.1%} over {spec['num_drafts']} drafting steps"
                       if spec["num_drafts"] else "no drafts proposed")
            extra = f", {x['speedup_vs_off']:.2f}x off's, {drafted}, = off {x['identical_to_off']}/{ts['num_requests']}"
            extra += (f"; costs {x['cost']:.1%}" if x["cost"] >= 0 else
                      f"; gains {-x['cost']:.1%} (drafts found in the model's own output)")
        print(f"  {name:12} {x['output_tokens_per_s']:8.1f} out tok/s{extra}")


def print_vllm(v: dict) -> None:
    print("\nvLLM (its own environment, the same prompts and token ids, its own n-gram and suffix speculation; one engine "
          "for every concurrency, so its suffix cache holds the answers of the concurrencies before: optimistic past 1)")
    if "skipped" in v:
        print(f"  not run: {v['skipped']}")
        return
    for name, x in v.items():
        if "skipped" in x:
            print(f"  {name:12} not run: {x['skipped']}")
            continue
        parts = []
        runs = {**{(f"{c} at once" if c != "1" else "one at a time"): y for c, y in x["concurrency"].items()},
                **({"agent": x["agent"]} if "agent" in x else {})}
        for label, y in runs.items():
            rel = f" ({y['speedup_vs_off']:.2f}x, = off {y['identical_to_off']}" if "speedup_vs_off" in y else ""
            if rel and y.get("spec_decode"):
                rel += f", acc len {y['spec_decode']['mean_acceptance_length']:.2f}"
            parts.append(f"{label} {y['output_tokens_per_s']:.1f}{rel + ')' if rel else ''}")
        print(f"  {name:12} vllm {x['version']} out tok/s: " + "; ".join(parts))


# ==== --workload moe, serve, ray ========================================================

def print_moe(r: dict) -> None:
    s, e, f = r["settings"], r["engine"], r["floor"]
    print(f"\nmixture of experts: {s['random_weights']} (random weights), {s['num_requests']} requests, input "
          f"{s['input_len'][0]}-{s['input_len'][1]}, output {s['output_len'][0]}-{s['output_len'][1]}, "
          f"{s['threads']} threads; {host(r['machine'])}")
    print(f"  nanopaged ({e['stats']['cpu_linear']}, {e['stats']['cpu_kernels']}, quantization "
          f"{(e['quantization'] or {}).get('quantization')}): trace {e['output_tokens_per_s']:.1f} tok/s, one request "
          f"{e['decode_tokens_per_s']:.2f} tok/s, loaded in {e['load_s']:.0f} s; busiest expert {e['expert_load']:.2f}x "
          "the mean")
    print(f"  active-weight floor: {f['active_weight_bytes'] / 1e9:.2f} GB a token at {f['read_bytes_per_s'] / 1e9:.1f} "
          f"GB/s read (a copy: {f['copy_bytes_per_s'] / 1e9:.1f} GB/s) = {f['decode_tokens_per_s']:.2f} tok/s; one "
          f"request at {f['fraction']:.0%} of it")
    v = r.get("vllm")
    if v and "error" in v:
        print(f"  vLLM CPU: {v['error']}")
    elif v:
        print(f"  vLLM CPU {v['version']}: trace {v['output_tokens_per_s']:.1f} tok/s, one request "
              f"{v['decode_tokens_per_s'] or 0:.2f} tok/s, loaded in {v['load_s']:.0f} s")
    for name, t in r["targets"].items():
        print(f"  target {name}: {t['value']:.2f} {'MET' if t['met'] else 'MISSED'}")


def print_serve(result: dict) -> None:
    s = result["settings"]
    chat = f" (chat: after a shared {s['system_prompt_words']}-word system prompt)" if "chat" in s["datasets"] else ""
    print(f"\nserve: {s['num_requests']} streamed requests per rate, Poisson arrivals at {', '.join(s['rates'])}/s, "
          f"prompts {s['input_len_words'][0]}-{s['input_len_words'][1]} words{chat}, "
          f"max_tokens {s['output_len'][0]}-{s['output_len'][1]}, "
          f"greedy; model {s['model']}, {s['device']} {s['dtype']}")
    for name, r in result["servers"].items():
        if "skipped" in r:
            print(f"{name} skipped: {r['skipped']}")
        elif r["server"].get("cpu_binding"):
            print(f"{name} {r['server'].get('version') or ''}: {', '.join(r['server']['cpu_binding'])}")
    for d in s["datasets"]:
        print(f"\n{d}:")
        head = (f"{'server':<22}{'rate':>5}{'done':>6}{'req/s':>7}{'out tok/s':>10}"
                f"{'TTFT p50/p99 ms':>17}{'TPOT p50/p99 ms':>17}{'ITL p50/p99 ms':>16}{'hits':>6}")
        print(head)
        print("-" * len(head))
        for name, r in result["servers"].items():
            for rate, f in r.get("datasets", {}).get(d, {}).items():
                print(f"{name:<22}{rate:>5}{f['completed']:>6}{f['requests_per_s']:>7.2f}"
                      f"{f['output_tokens_per_s']:>10.1f}{_p50_p99(f, 'ttft', '.0f'):>17}"
                      f"{_p50_p99(f, 'tpot', '.1f'):>17}{_p50_p99(f, 'itl', '.1f'):>16}"
                      f"{'-' if f.get('prefix_hit_rate') is None else format(f['prefix_hit_rate'], '.0%'):>6}")
                if f["failed"]:
                    print(f"{'':<22}{f['failed']} failed: {f['errors']}")
        for peer, n in result["same_text"].get(d, {}).items():
            print(f"greedy answers identical to nanopaged's: {peer} {n['identical']} of {n['of']}")
        print(f"targets (issue 40), {d}: " + "; ".join(describe_target(t) for t in result["targets"][d].values()))
        print_data_parallel(result["servers"], d)


def print_data_parallel(servers: dict, d: str) -> None:
    """Issue 55's targets, where dp2 servers ran: all at once, out tok/s at least one core's (DP=1, both
    threads); prefix-aware routing's hit rate within 5 points of one core's (round-robin's reported)."""
    one = servers.get("nanopaged", {}).get("datasets", {}).get(d, {}).get("inf")
    for name, r in servers.items():
        f = r.get("datasets", {}).get(d, {}).get("inf")
        if not name.startswith("dp2-") or f is None or one is None or not one["output_tokens_per_s"]:
            continue
        ratio = f["output_tokens_per_s"] / one["output_tokens_per_s"]
        line = f"{name} all at once: {ratio:.2f}x one engine core's out tok/s (>= 1): {'met' if ratio >= 1 else 'missed'}"
        if f.get("prefix_hit_rate") is not None and one.get("prefix_hit_rate") is not None:
            gap = one["prefix_hit_rate"] - f["prefix_hit_rate"]
            line += f"; hit rate {f['prefix_hit_rate']:.0%} against {one['prefix_hit_rate']:.0%}"
            line += f" (prefix-aware within 5 points: {'met' if gap <= 0.05 else 'missed'})" if "prefix" in name else ""
        print(line)


def _p50_p99(f: dict, key: str, fmt: str) -> str:
    return "/".join(format(f[f"{key}_ms_{p}"], fmt) for p in ("p50", "p99"))


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


# ==== the research tool (benchmarks/research/tensor_parallel.py) =====================

def print_tensor_parallel_head(args) -> None:
    print(f"{args.random_weights} (random weights, float32), {args.num_requests} requests, input "
          f"{args.input_len[0]}-{args.input_len[1]}, output {args.output_len[0]}-{args.output_len[1]}, "
          f"{args.num_kv_blocks} KV blocks")
    print("| N | weights per rank MiB | KV cache per rank MiB | bytes sent per step | out tok/s | wall s |")
    print("|---|---|---|---|---|---|")


def tensor_parallel_row(r: dict) -> str:
    weights = " / ".join(f"{w / 2**20:.1f}" for w, _ in r["memory"])
    kv = " / ".join(f"{k / 2**20:.1f}" for _, k in r["memory"])
    message = f"{r['bytes_per_step']:,.0f}" if r["size"] > 1 else "-"
    return (f"| {r['size']} | {weights} | {kv} | {message} | {r['out_tok_s']:.1f} | {r['wall_s']:.1f} |")
