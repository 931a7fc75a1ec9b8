"""One-item-at-a-time packing cores: best fit under extra budgets, first fit, next fit.

Used when the whole-length cores of ``histogram.py`` cannot be: a vision budget, a samples-per-bin cap,
or a strategy that keeps data order. Each core takes lengths (1..capacity, validated) in *processing
order* and returns ``item_bin`` (the bin, numbered in opening order, of each item) and the bin count.
"""

from __future__ import annotations

import bisect


def _tree_set(tree: list[int], node: int, value: int) -> None:
    """Set leaf ``j`` (already offset by the tree size) of a max segment tree and fix its ancestors."""
    tree[node] = value
    node >>= 1
    while node:
        left_max, right_max = tree[2 * node], tree[2 * node + 1]
        larger = left_max if left_max > right_max else right_max
        if tree[node] == larger:
            break
        tree[node] = larger
        node >>= 1


def _tree_first_at_least(tree: list[int], size: int, lo: int, value: int) -> int:
    """Leftmost leaf index >= ``lo`` whose value is >= ``value`` in a max segment tree, or -1."""
    node = lo + size
    if tree[node] < value:
        while True:  # climb to the next subtree to the right that holds a large enough leaf
            while node & 1:
                node >>= 1
            if node == 0:
                return -1
            node += 1
            if tree[node] >= value:
                break
        while node < size:
            node = 2 * node if tree[2 * node] >= value else 2 * node + 1
    return node - size


def _bfd_constrained(
    lens: list[int], visions: list[int] | None, capacity: int, vision_cap: int, sample_cap: int, shortest: int
) -> tuple[list[int], int]:
    """Best fit with a vision budget and/or a samples-per-bin cap, one item at a time, O(log C).

    Same rule as :func:`_bfd_histogram` among the bins that satisfy every budget: least free token
    space, then most recently modified. Bins are bucketed by free token space ``r``; a max segment
    tree over ``r`` holds each bucket's largest free vision budget, so the best bucket is the
    leftmost ``r >= L`` whose entry is ``>= v``, and inside it the topmost bin with room for ``v``.
    Bins that reached ``max_samples_per_bin`` samples, or whose free space is below the shortest item, leave the
    index for good.
    """
    size = 1 << capacity.bit_length()  # leaves 0..capacity
    tree = [-1] * (2 * size)  # -1: empty bucket
    buckets: dict[int, list[int]] = {}
    free: list[int] = []
    vision_free: list[int] = []
    count: list[int] = []
    item_bin = [0] * len(lens)
    for item, length in enumerate(lens):
        vision = visions[item] if visions is not None else 0
        bucket_free = _tree_first_at_least(tree, size, length, vision)
        if bucket_free >= 0:
            stack = buckets[bucket_free]
            depth = len(stack) - 1
            while vision_free[stack[depth]] < vision:
                depth -= 1
            bin_id = stack.pop(depth)
            if not stack:
                del buckets[bucket_free]
                _tree_set(tree, bucket_free + size, -1)
            elif vision_free[bin_id] == tree[bucket_free + size]:
                _tree_set(tree, bucket_free + size, max([vision_free[other] for other in stack]))
        else:
            bin_id = len(free)
            free.append(capacity)
            vision_free.append(vision_cap)
            count.append(0)
        left = free[bin_id] - length
        free[bin_id] = left
        vision_left = vision_free[bin_id] - vision
        vision_free[bin_id] = vision_left
        count[bin_id] += 1
        item_bin[item] = bin_id
        if left >= shortest and count[bin_id] < sample_cap:
            stack = buckets.get(left)
            if stack is None:
                buckets[left] = [bin_id]
                _tree_set(tree, left + size, vision_left)
            else:
                stack.append(bin_id)
                if vision_left > tree[left + size]:
                    _tree_set(tree, left + size, vision_left)
    return item_bin, len(free)


def _bfd_capped(lens: list[int], capacity: int, sample_cap: int, shortest: int) -> tuple[list[int], int]:
    """Best fit with only a samples-per-bin cap: full bins leave the index, so the top of the smallest
    bucket ``r >= L`` is always the answer (bisect on the sorted free-space keys)."""
    buckets: dict[int, list[int]] = {}
    keys: list[int] = []
    free: list[int] = []
    count: list[int] = []
    item_bin = [0] * len(lens)
    bisect_left = bisect.bisect_left
    insort = bisect.insort
    for item, length in enumerate(lens):
        pos = bisect_left(keys, length)
        if pos < len(keys):
            bucket_free = keys[pos]
            stack = buckets[bucket_free]
            bin_id = stack.pop()
            if not stack:
                del buckets[bucket_free]
                del keys[pos]
        else:
            bin_id = len(free)
            free.append(capacity)
            count.append(0)
        left = free[bin_id] - length
        free[bin_id] = left
        in_bin = count[bin_id] + 1
        count[bin_id] = in_bin
        item_bin[item] = bin_id
        if left >= shortest and in_bin < sample_cap:
            stack = buckets.get(left)
            if stack is None:
                buckets[left] = [bin_id]
                insort(keys, left)
            else:
                stack.append(bin_id)
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
    lens: list[int], visions: list[int] | None, capacity: int, vision_cap: int, sample_cap: int, shortest: int
) -> tuple[list[int], int]:
    """Exact first fit: each item into the lowest-numbered bin where it satisfies every budget.

    A max tree over bins of free tokens finds the leftmost bin with room in O(log bins); with a
    vision budget a second tree (free vision) prunes a leftmost-first search over both.
    """
    trees = _BinTree()
    free: list[int] = []
    vision_free: list[int] = []
    count: list[int] = []
    item_bin = [0] * len(lens)
    for item, length in enumerate(lens):
        free_tree = trees.tf
        size = trees.size
        if visions is None:
            bin_id = _tree_first_at_least(free_tree, size, 0, length)
        else:
            vision = visions[item]
            vision_tree = trees.tv
            bin_id = -1
            todo = [1]
            while todo:  # leftmost-first search, pruned where either budget cannot fit
                node = todo.pop()
                if free_tree[node] < length or vision_tree[node] < vision:
                    continue
                if node >= size:
                    bin_id = node - size
                    break
                todo.append(2 * node + 1)
                todo.append(2 * node)
        if bin_id < 0:
            bin_id = len(free)
            if bin_id == trees.size:
                trees.grow()
            free.append(capacity)
            vision_free.append(vision_cap)
            count.append(0)
        left = free[bin_id] - length
        free[bin_id] = left
        count[bin_id] += 1
        item_bin[item] = bin_id
        alive = left >= shortest and count[bin_id] < sample_cap
        _tree_set(trees.tf, bin_id + trees.size, left if alive else -1)
        if visions is not None:
            vision_free[bin_id] -= visions[item]
            _tree_set(trees.tv, bin_id + trees.size, vision_free[bin_id] if alive else -1)
    return item_bin, len(free)


def _next_fit(
    lens: list[int], visions: list[int] | None, capacity: int, vision_cap: int, sample_cap: int
) -> tuple[list[int], int]:
    """Next fit: keep one open bin; open a new one when the item does not fit it."""
    item_bin = [0] * len(lens)
    bin_id = -1
    used = capacity + 1
    vision_used = 0
    in_bin = 0
    if visions is None:
        for item, length in enumerate(lens):
            if used + length > capacity or in_bin >= sample_cap:
                bin_id += 1
                used = 0
                in_bin = 0
            used += length
            in_bin += 1
            item_bin[item] = bin_id
    else:
        for item, length in enumerate(lens):
            vision = visions[item]
            if used + length > capacity or vision_used + vision > vision_cap or in_bin >= sample_cap:
                bin_id += 1
                used = vision_used = in_bin = 0
            used += length
            vision_used += vision
            in_bin += 1
            item_bin[item] = bin_id
    return item_bin, bin_id + 1


# ----------------------------------------------------------------------------- pack
