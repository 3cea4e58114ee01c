"""Expert parallelism's dispatch as xorl moves it: the rows a token sends and the bytes its routed
rows stream through HBM (xorl/nn/ep_dispatch.py, xorl/nn/moe.py); step_time.py prices them.
tests/unit/planner/test_published_moe.py holds both to counts and traces of the real dispatch."""

from __future__ import annotations


def ep_pairs_per_token(experts: int, top_k: int, ep: int) -> float:
    """Rows a token sends in EP's dispatch (and gets back in the combine): one per destination rank
    that owns at least one of its top_k experts, not one per expert (xorl/nn/ep_dispatch.py sends a
    token routed to several experts of one rank there once, as DeepEP does). Balanced routing, as
    everywhere here: the top_k distinct experts uniformly at random, so a rank owning experts / ep
    of them is missed with probability C(E - E/ep, k) / C(E, k). Qwen3-30B (top-8 of 128) at EP 4:
    3.63, the figure ep_dispatch.py states; at EP 8: 5.30 rows, not 8."""
    local, missed = experts // ep, 1.0
    for i in range(top_k):
        missed *= max(0, experts - local - i) / (experts - i)
    return ep * (1 - missed)


def routed_copy_bytes(k: int, pairs: float, a: int, ep: int) -> float:
    """Bytes per token and hidden unit that moving a token's routed rows streams through HBM,
    forward, as xorl/nn/moe.py and xorl/nn/ep_dispatch.py run it (the row moves are
    xorl_kernels.moe_permute's), each op reading its inputs once and writing its outputs once (the
    traffic convention of tests/unit/planner/test_fp8_time.py; test_plan_published_moe.py traces the dispatch).

    ep 1: permute_tokens gathers k rows of x (reads x, writes k rows: a + a k); unpermute_tokens
    combines them with their weights in fp32 registers (reads k rows, writes one): 2 a k + 2 a.
    ep > 1, per token's k slots and ``pairs`` (token, rank) rows (ep_pairs_per_token): the pairs'
    rows gathered to send (a + a pairs); on arrival expanded to the slots (a pairs + a k);
    permute_tokens and unpermute_tokens over the slots (2 a k each); the slots cast to fp32 (a + 4)
    and weighted (8) per slot; index_add-ed into fresh fp32 pair rows (the zeros 4, then 4 + 4 per
    pair and 4 per slot), cast back (4 + a per pair); after the combine's all-to-all each token's
    pairs cast to fp32 (a + 4 per pair) and index_add-ed into a fresh fp32 row (4, then 8 + 4 per
    pair), cast back (4 + a): (6a + 16) k + (4a + 24) pairs + 16 + 2a."""
    if ep <= 1:
        return 2 * a * k + 2 * a
    return (6 * a + 16) * k + (4 * a + 24) * pairs + 16 + 2 * a
