"""The machine-independent counts of :mod:`benchmarks.opcount` as markdown tables: operations per chunk and layer,
the prefill's largest tensors, recorded rollout chunks and decoding steps, golden's pooled pass."""


def opcount_table(res: dict) -> str:
    lines = ["| policy | plain forward ops / chunk / layer | rollout | extra |", "|---|---|---|---|"]
    lines += [f"| {r['policy']} | {r['plain_per_chunk_layer']} | {r['rollout_per_chunk_layer']} | "
              f"+{r['extra_per_chunk_layer']} |" for r in res["ops"]]
    lines += ["", "| policy | prompt | largest transient tensor in the prefill | bound max(b·V, b·H·L·(B+L)) | largest "
              "resident (the cache's storage) |", "|---|---|---|---|---|"]
    lines += [f"| {r['policy']} | {r['prompt_len']} | {r['largest_transient']:,} | {r['bound']:,} | {r['largest_resident']:,} |"
              for r in res["prefill"]]
    lines += ["", "| policy | rollout ops / chunk / layer past the first eviction, eager | chunks recorded (`step=\"graph\"`; "
              "a replay counts one) |", "|---|---|---|"]
    lines += [f"| {r['policy']} | {r['eager_per_chunk_layer']} | {r['recorded_per_chunk_layer']} |"
              for r in res.get("recorded", [])]
    lines += ["", "| policy | ops per generated token, eager decoding | recorded step (`step=\"graph\"`: one replay + the "
              "host's work between steps) | host syncs per token, eager · recorded |", "|---|---|---|---|"]
    lines += [f"| {r['policy']} | {r['eager_per_token']} | {r['graph_per_token']} | {r['eager_syncs_per_token']} · "
              f"{r['graph_syncs_per_token']} |" for r in res.get("decode", [])]
    if res.get("golden"):
        g = res["golden"]
        lines += ["", "| golden labels' pooled pass, ops per block of L queries | one block per forward (CPU) | blocks "
                  "per forward up to the memory limit (accelerator) | plain forward, L tokens at a time |",
                  "|---|---|---|---|", f"| S={g['S']}, B={g['B']}, L={g['L']} | {g['cpu_per_block']} | "
                  f"{g['accelerator_per_block']} | {g['plain_per_block']} |"]
    return "\n".join(lines)
