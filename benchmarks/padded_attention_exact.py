"""Is attention over a padded batch bit-for-bit what each sequence gets alone? Random queries, keys and values in a
decode step's shapes (15-22 rows over 20-300 earlier keys, 4 query heads over 2 key/value heads, masks that hide a
fifth of the keys), attended one sequence at a time and as one padded batch (padding hidden by the mask).

    OMP_NUM_THREADS=2 python benchmarks/padded_attention_exact.py

The engine promises that a request's answer does not depend on what shares its forwards; batched attention would
keep that only if this prints 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def main(trials: int = 60, batch: int = 8, heads: int = 4, kv_heads: int = 2, dim: int = 64) -> None:
    torch.manual_seed(0)
    differ = total = 0
    for _ in range(trials):
        rows = [int(torch.randint(15, 23, ())) for _ in range(batch)]
        past = [int(torch.randint(20, 300, ())) for _ in range(batch)]
        keys = [s + t for s, t in zip(past, rows, strict=True)]
        qs = [torch.randn(1, heads, t, dim) for t in rows]
        ks = [torch.randn(1, kv_heads, n, dim) for n in keys]
        vs = [torch.randn(1, kv_heads, n, dim) for n in keys]
        masks = [torch.where(torch.rand(t, n) < 0.8, 0.0, float("-inf"))[None, None]
                 for t, n in zip(rows, keys, strict=True)]
        for m in masks:
            m[..., 0] = 0.0  # every row sees a key
        alone = [F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
                 for q, k, v, m in zip(qs, ks, vs, masks, strict=True)]
        t_max, n_max = max(rows), max(keys)
        q_pad = torch.zeros(batch, heads, t_max, dim)
        k_pad, v_pad = torch.zeros(batch, kv_heads, n_max, dim), torch.zeros(batch, kv_heads, n_max, dim)
        m_pad = torch.full((batch, 1, t_max, n_max), float("-inf"))
        m_pad[..., 0] = 0.0
        for b in range(batch):
            q_pad[b, :, : rows[b]] = qs[b][0]
            k_pad[b, :, : keys[b]], v_pad[b, :, : keys[b]] = ks[b][0], vs[b][0]
            m_pad[b, :, : rows[b], : keys[b]] = masks[b][0]
        together = F.scaled_dot_product_attention(q_pad, k_pad, v_pad, attn_mask=m_pad, enable_gqa=True)
        for b in range(batch):
            total += 1
            differ += not torch.equal(together[b : b + 1, :, : rows[b]], alone[b])
    print(f"sequences whose padded-batch attention is not bit-equal to their own: {differ} of {total}")


if __name__ == "__main__":
    main()
