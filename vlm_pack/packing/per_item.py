"""One-item-at-a-time packing cores: best fit under extra budgets, first fit, next fit.

Used when the whole-length cores of ``histogram.py`` cannot be: a vision budget, a samples-per-bin cap,
or a strategy that keeps data order. Each core takes lengths (1..capacity, validated) in *processing
order* and returns ``item_bin`` (the bin, numbered in opening order, of each item) and the bin count.
"""

from __future__ import annotations

import bisect


def _tree_set(tree: list[int], j: int, value: int) -> None:
    """Set leaf ``j`` (already offset by the tree size) of a max segment tree and fix its ancestors."""
    tree[j] = value
    j >>= 1
    while j:
        a, c = tree[2 * j], tree[2 * j + 1]
        m = a if a > c else c
        if tree[j] == m:
            break
        tree[j] = m
        j >>= 1


def _tree_first_at_least(tree: list[int], size: int, lo: int, value: int) -> int:
    """Leftmost leaf index >= ``lo`` whose value is >= ``value`` in a max segment tree, or -1."""
    i = lo + size
    if tree[i] < value:
        while True:  # climb to the next subtree to the right that holds a large enough leaf
            while i & 1:
                i >>= 1
            if i == 0:
                return -1
            i += 1
            if tree[i] >= value:
                break
        while i < size:
            i = 2 * i if tree[2 * i] >= value else 2 * i + 1
    return i - size


def _bfd_constrained(
    lens: list[int], vis: list[int] | None, capacity: int, vcap: int, max_n: int, lmin: int
) -> tuple[list[int], int]:
    """Best fit with a vision budget and/or a samples-per-bin cap, one item at a time, O(log C).

    Same rule as :func:`_bfd_histogram` among the bins that satisfy every budget: least free token
    space, then most recently modified. Bins are bucketed by free token space ``r``; a max segment
    tree over ``r`` holds each bucket's largest free vision budget, so the best bucket is the
    leftmost ``r >= L`` whose entry is ``>= v``, and inside it the topmost bin with room for ``v``.
    Bins that reached ``max_n`` samples, or whose free space is below the shortest item, leave the
    index for good.
    """
    size = 1 << capacity.bit_length()  # leaves 0..capacity
    tree = [-1] * (2 * size)  # -1: empty bucket
    buckets: dict[int, list[int]] = {}
    free: list[int] = []
    vfree: list[int] = []
    count: list[int] = []
    item_bin = [0] * len(lens)
    for t, length in enumerate(lens):
        v = vis[t] if vis is not None else 0
        r = _tree_first_at_least(tree, size, length, v)
        if r >= 0:
            stack = buckets[r]
            pos = len(stack) - 1
            while vfree[stack[pos]] < v:
                pos -= 1
            b = stack.pop(pos)
            if not stack:
                del buckets[r]
                _tree_set(tree, r + size, -1)
            elif vfree[b] == tree[r + size]:
                _tree_set(tree, r + size, max([vfree[x] for x in stack]))
        else:
            b = len(free)
            free.append(capacity)
            vfree.append(vcap)
            count.append(0)
        d = free[b] - length
        free[b] = d
        vf = vfree[b] - v
        vfree[b] = vf
        count[b] += 1
        item_bin[t] = b
        if d >= lmin and count[b] < max_n:
            stack = buckets.get(d)
            if stack is None:
                buckets[d] = [b]
                _tree_set(tree, d + size, vf)
            else:
                stack.append(b)
                if vf > tree[d + size]:
                    _tree_set(tree, d + size, vf)
    return item_bin, len(free)


def _bfd_capped(lens: list[int], capacity: int, max_n: int, lmin: int) -> tuple[list[int], int]:
    """Best fit with only a samples-per-bin cap: full bins leave the index, so the top of the smallest
    bucket ``r >= L`` is always the answer (bisect on the sorted free-space keys)."""
    buckets: dict[int, list[int]] = {}
    keys: list[int] = []
    free: list[int] = []
    count: list[int] = []
    item_bin = [0] * len(lens)
    bisect_left = bisect.bisect_left
    insort = bisect.insort
    for t, length in enumerate(lens):
        i = bisect_left(keys, length)
        if i < len(keys):
            r = keys[i]
            stack = buckets[r]
            b = stack.pop()
            if not stack:
                del buckets[r]
                del keys[i]
        else:
            b = len(free)
            free.append(capacity)
            count.append(0)
        d = free[b] - length
        free[b] = d
        c = count[b] + 1
        count[b] = c
        item_bin[t] = b
        if d >= lmin and c < max_n:
            stack = buckets.get(d)
            if stack is None:
                buckets[d] = [b]
                insort(keys, d)
            else:
                stack.append(b)
    return item_bin, len(free)


class _BinTree:
    """Max segment trees over bins (free tokens, free vision), grown by doubling; -1 marks closed bins."""

    __slots__ = ("size", "tf", "tv")

    def __init__(self) -> None:
        self.size = 1024
        self.tf = [-1] * (2 * self.size)
        self.tv = [-1] * (2 * self.size)

    def grow(self) -> None:
        size = self.size * 2
        for name in ("tf", "tv"):
            old = getattr(self, name)[self.size :]
            tree = [-1] * (2 * size)
            tree[size : size + len(old)] = old
            for j in range(size - 1, 0, -1):
                a, b = tree[2 * j], tree[2 * j + 1]
                tree[j] = a if a > b else b
            setattr(self, name, tree)
        self.size = size



def _first_fit(
    lens: list[int], vis: list[int] | None, capacity: int, vcap: int, max_n: int, lmin: int
) -> tuple[list[int], int]:
    """Exact first fit: each item into the lowest-numbered bin where it satisfies every budget.

    A max tree over bins of free tokens finds the leftmost bin with room in O(log bins); with a
    vision budget a second tree (free vision) prunes a leftmost-first search over both.
    """
    bt = _BinTree()
    free: list[int] = []
    vfree: list[int] = []
    count: list[int] = []
    item_bin = [0] * len(lens)
    for t, length in enumerate(lens):
        tf = bt.tf
        size = bt.size
        if vis is None:
            b = _tree_first_at_least(tf, size, 0, length)
        else:
            v = vis[t]
            tv = bt.tv
            b = -1
            todo = [1]
            while todo:  # leftmost-first search, pruned where either budget cannot fit
                i = todo.pop()
                if tf[i] < length or tv[i] < v:
                    continue
                if i >= size:
                    b = i - size
                    break
                todo.append(2 * i + 1)
                todo.append(2 * i)
        if b < 0:
            b = len(free)
            if b == bt.size:
                bt.grow()
            free.append(capacity)
            vfree.append(vcap)
            count.append(0)
        d = free[b] - length
        free[b] = d
        count[b] += 1
        item_bin[t] = b
        alive = d >= lmin and count[b] < max_n
        _tree_set(bt.tf, b + bt.size, d if alive else -1)
        if vis is not None:
            vfree[b] -= vis[t]
            _tree_set(bt.tv, b + bt.size, vfree[b] if alive else -1)
    return item_bin, len(free)


def _next_fit(
    lens: list[int], vis: list[int] | None, capacity: int, vcap: int, max_n: int
) -> tuple[list[int], int]:
    """Next fit: keep one open bin; open a new one when the item does not fit it."""
    item_bin = [0] * len(lens)
    b = -1
    used = capacity + 1
    vused = 0
    n_in = 0
    if vis is None:
        for t, length in enumerate(lens):
            if used + length > capacity or n_in >= max_n:
                b += 1
                used = 0
                n_in = 0
            used += length
            n_in += 1
            item_bin[t] = b
    else:
        for t, length in enumerate(lens):
            v = vis[t]
            if used + length > capacity or vused + v > vcap or n_in >= max_n:
                b += 1
                used = vused = n_in = 0
            used += length
            vused += v
            n_in += 1
            item_bin[t] = b
    return item_bin, b + 1


# ----------------------------------------------------------------------------- pack

