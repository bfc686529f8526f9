"""EAGLE-2 dynamic draft trees (Li et al. 2024, arXiv:2406.16858): build, mask, verify.

Building (`TreeShape`): the root is the pending token; its children are the drafter's top-k
tokens. At every further depth the `topk` frontier nodes with the highest cumulative
log-probability (the product of the drafter's probabilities along the path) are expanded in
one drafter forward, each into its top-k children. After `depth` levels the `total_tokens`
best nodes of everything drafted are kept (reranking); a child never scores above its parent,
so the kept set is closed under ancestors. `TreeLevels` holds the candidates as tensors on the
drafter's device and `select_tree` reranks them there, so drafting a tree reads nothing back.
Drafters that give every depth's law from one forward (P-EAGLE, block drafters) build the same
levels without a forward each (`slot_tree`).

Prompt lookup (`TreeShape.lookup`, as transformers' `prompt_lookup_num_tokens` and Saxena's prompt
lookup decoding): the tokens that followed the latest earlier occurrence of the sequence's
ending are grafted on the tree as one more branch, sharing the drafter's nodes as far as they
agree. Text that repeats itself (quoted passages, lists, loops) is then drafted many tokens deep
at the price of a few verified rows.

Verification: every node is a deterministic draft (q = one-hot). Greedy decoding follows the
child that equals the target's argmax. Sampling is sibling-wise: at a node with target law p,
each child x in turn is accepted with probability p(x); on rejection p(x) is zeroed and p
renormalized (the residual norm(max(0, p − onehot(x)))); when every child is rejected the
token is drawn from what remains, and a fully accepted leaf draws its bonus token from p.
The committed tokens therefore follow p exactly.

Notation: n tree nodes (the root excluded), S cached target positions, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from draftsmith import DraftsmithError
from draftsmith.models.common import additive_mask
from draftsmith.runtime.steps import DraftStep, TreeLevel
from draftsmith.runtime.sampling import sample


@dataclass(frozen=True)
class TreeShape:
    """EAGLE-2's tree parameters: expand `topk` nodes per level into `topk` children each, for
    `depth` levels, then keep the `total_tokens` best nodes; `lookup` > 0 grafts a prompt-lookup
    branch of up to that many tokens on top."""

    depth: int = 5
    topk: int = 8
    total_tokens: int = 32
    lookup: int = 0

    def __post_init__(self) -> None:
        if self.depth < 1 or self.topk < 1 or self.total_tokens < 1:
            raise DraftsmithError(f"tree depth, topk and total_tokens must be >= 1, got {self}")
        if self.lookup < 0:
            raise DraftsmithError(f"prompt lookup takes a number of tokens >= 0 (0: off), got {self.lookup}")

    @classmethod
    def parse(cls, tree: str | None, lookup: int = 0) -> "TreeShape | None":
        """--tree DEPTH,TOPK,TOKENS as a TreeShape (None: chain drafts)."""
        if tree is None:
            return None
        try:
            depth, topk, total = (int(x) for x in str(tree).strip("[]() ").split(","))
        except ValueError:
            raise DraftsmithError(f"--tree takes DEPTH,TOPK,TOKENS (e.g. 5,8,32), got {tree!r}") from None
        return cls(depth, topk, total, lookup)


@dataclass
class DraftTree:
    """n drafted nodes, parents before children: breadth-first (siblings by score) as drafted, a
    grafted prompt-lookup branch after them.

    tokens (n,) target ids; parents (n,) the parent's index, -1 for the root (the pending
    token); depth (n,) 1 for the root's children; scores (n,) cumulative log-probability.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    scores: torch.Tensor

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if len(self) else 0

    def children(self) -> list[list[int]]:
        """children()[i + 1] lists node i's children (index 0 is the root), in score order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, parent in enumerate(self.parents.tolist()):
            kids[parent + 1].append(i)
        return kids



def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """(n, n) bool: [i, j] is True when node j is node i or one of its ancestors.

    `parents` must list parents before children. One vectorized step per tree level: after d
    steps every node at depth ≤ d has its full row."""
    n = parents.shape[0]
    index = torch.arange(n, device=parents.device)
    if bool((parents >= index).any()):
        i = int((parents >= index).nonzero()[0])
        raise DraftsmithError(f"tree node {i} has parent {int(parents[i])}: parents must come before children")
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    has_parent, parent = (parents >= 0)[:, None], parents.clamp(min=0)
    anc = eye
    for _ in range(n):
        grown = eye | (anc[parent] & has_parent)
        if torch.equal(grown, anc):
            break
        anc = grown
    return anc


def tree_attention_mask(tree: DraftTree, cached: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Mask (1, 1, n+1, cached+n+1) for the verification forward of [root, nodes]: every row sees
    the cache and the root; node rows see their ancestors and themselves. Boolean (True: attend;
    what SDPA takes as it is) when `dtype` is None, else additive (`additive_mask`)."""
    return _as_mask(_tree_allowed(tree, cached), dtype)


def _tree_allowed(tree: DraftTree, cached: int) -> torch.Tensor:
    """tree_attention_mask's rows, boolean (n+1, cached+n+1)."""
    n = len(tree)
    allowed = torch.ones(n + 1, cached + n + 1, dtype=torch.bool, device=tree.tokens.device)
    allowed[0, cached + 1:] = False
    allowed[1:, cached + 1:] = ancestor_matrix(tree.parents)
    return allowed


def _as_mask(allowed: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """(1, 1, rows, keys): boolean as it is (dtype None), else additive."""
    return allowed[None, None] if dtype is None else additive_mask(allowed, dtype)[None, None]


def sliding_window(config) -> tuple[int | None, bool]:
    """(window, by layer type) of a target config: the window its sliding layers attend over (None: no
    sliding layer) and whether the model takes one mask per layer type (`layer_types`: Gemma 3, gpt-oss,
    Qwen 2/3) or one mask for every layer (Mistral, Phi-3: a single `sliding_window`)."""
    types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    if types:
        return (window if "sliding_attention" in types else None), True
    return window, False


def tree_attention_masks(tree: DraftTree, cached: int, config, dtype: torch.dtype | None = None):
    """What a target's decoder takes as the tree's attention mask: `tree_attention_mask`, and for sliding
    layers the same windowed (a layer that attends to the last `window` positions, as transformers'
    sliding masks do): a row at position P sees only keys at positions above P − window, a node's
    position being cached + its depth. One tensor, or a mapping layer type → mask for models that mask
    by layer type."""
    window, by_type = sliding_window(config)
    allowed = _tree_allowed(tree, cached)
    if window is None:
        return _as_mask(allowed, dtype)
    query = cached + torch.cat([tree.depth.new_zeros(1), tree.depth]).to(allowed.device)  # (n+1,) positions
    key = torch.cat([torch.arange(cached, device=allowed.device), query])  # (cached+n+1,)
    windowed = _as_mask(allowed & ((query[:, None] - key[None, :]) < window), dtype)
    return {"full_attention": _as_mask(allowed, dtype), "sliding_attention": windowed} if by_type else windowed


def select_tree(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor, depth: torch.Tensor,
                total_tokens: int) -> DraftTree:
    """The `total_tokens` best of N candidates (tokens, parent candidate index or -1, score, depth;
    each (N,)) as a breadth-first DraftTree: by depth, then score, then candidate order. The best
    are by score, ties to the shallower, then to the earlier. That set is closed under ancestors,
    as a child's score is its parent's plus a log-probability (≤ 0), so never above it, and a tie
    goes to the parent. All on the candidates' device, without reading a value on the host."""
    n = tokens.shape[0]

    def by(keys: torch.Tensor, order: torch.Tensor) -> torch.Tensor:  # a stable sort of `order` by keys[order]
        return order[torch.sort(keys[order], stable=True).indices]

    order = torch.arange(n, device=tokens.device)
    kept = by(-scores, by(depth, order))[:total_tokens]  # best first: score, depth, index
    nodes = by(depth, by(-scores, kept.sort().values))  # breadth-first: depth, score, index
    position = torch.full((n,), -1, dtype=torch.long, device=tokens.device)
    position[nodes] = torch.arange(nodes.shape[0], device=tokens.device)
    parent = parents[nodes]
    return DraftTree(tokens=tokens[nodes], parents=torch.where(parent >= 0, position[parent.clamp(min=0)], -1),
                     depth=depth[nodes], scores=scores[nodes].float())


def prune(tree: DraftTree, n: int) -> DraftTree:
    """The tree's `n` best drafted nodes (by score, ties to the shallower, closed under ancestors),
    breadth-first as `select_tree` orders them; the tree itself when it has no more than n."""
    if n >= len(tree):
        return tree
    return select_tree(tree.tokens, tree.parents, tree.scores, tree.depth, n)


def slot_tree(first: torch.Tensor, later: Callable[[int, torch.Tensor], torch.Tensor], shape: TreeShape,
              to_target: torch.Tensor | None) -> DraftTree:
    """A tree from a drafter that gives every depth's law without a forward per level (P-EAGLE, DFlash and
    DSpark draft a block in one forward). `first` (V,): the log-law of the root's children; `later(j,
    parents)`: the log-laws (m, V) of depth j + 1's children of m parents at depth j (their target ids
    (m,)) — one row repeated where a slot's law does not read the token before it (P-EAGLE, DFlash),
    DSpark's Markov bias from each parent. Levels are chosen as EAGLE-2's (the `topk` best frontier nodes
    get their `topk` best children), then the `total_tokens` best nodes are kept (`select_tree`)."""
    ids = (lambda i: i) if to_target is None else (lambda i: to_target[i])
    top = first.topk(min(shape.topk, first.shape[-1]))
    k, device = top.indices.shape[0], first.device
    tokens, scores, parents = [ids(top.indices)], [top.values.clamp(max=0)], [torch.full((k,), -1, dtype=torch.long, device=device)]
    start = 0  # candidate index of the newest level's first node
    for depth in range(2, shape.depth + 1):
        order = torch.sort(scores[-1], descending=True, stable=True).indices[: shape.topk]
        top = later(depth - 1, tokens[-1][order]).topk(k)
        tokens.append(ids(top.indices).reshape(-1))
        scores.append((scores[-1][order][:, None] + top.values.clamp(max=0)).reshape(-1))  # a child ≤ its parent
        parents.append((start + order).repeat_interleave(k))
        start += tokens[-2].shape[0]
    depths = torch.cat([torch.full_like(t, d) for d, t in enumerate(tokens, 1)])
    return select_tree(torch.cat(tokens), torch.cat(parents), torch.cat(scores), depths, shape.total_tokens)


@dataclass
class Frontier:
    """A tree level's F candidates: tokens (F,) target ids, scores (F,) cumulative log-probabilities,
    `rows` (F,) of `states` (m, H), the drafter outputs that predicted them, `ancestors` (F, E_max) which
    expanded nodes are their ancestors, and `first` the candidate index of the first of them."""

    tokens: torch.Tensor
    scores: torch.Tensor
    states: torch.Tensor
    rows: torch.Tensor
    ancestors: torch.Tensor
    first: int


class TreeLevels:
    """An EAGLE-2 tree's candidates level by level, as tensors on the drafter's device (a feature
    drafter's `propose_tree` fills it), with what `expand` policies read."""

    def __init__(self, root_state: torch.Tensor, max_expanded: int):
        self.root_state, self.max_expanded = root_state, max_expanded  # (1, H): predicts the root's children
        self.tokens, self.parents, self.scores, self.depths = [], [], [], []  # per level, global candidate order
        self.count, self.expanded = 0, 0
        # each level's predicting states and log-distributions (row i of level d: its i-th expanded node)
        self.states, self.logps = [root_state], []

    def add_children(self, logp: torch.Tensor, topk: int, parent: tuple | None,
                     to_target: torch.Tensor | None) -> Frontier:
        """The `topk` best children of each state behind `logp` (m, V): the next frontier. `parent`:
        (frontier, order, seen) of the nodes just expanded, None for the root."""
        self.logps.append(logp)
        top = logp.topk(min(topk, logp.shape[-1]), dim=-1)
        m, k, device = logp.shape[0], top.indices.shape[1], logp.device
        tokens = (top.indices if to_target is None else to_target[top.indices]).reshape(-1)
        rows = torch.arange(m, device=device).repeat_interleave(k)
        values = top.values.clamp(max=0)  # a log-probability: rounding must not lift a child above its parent
        if parent is None:
            scores, parents = values.reshape(-1), torch.full((m * k,), -1, dtype=torch.long, device=device)
            ancestors = torch.zeros(m * k, self.max_expanded, dtype=torch.bool, device=device)
            states = self.root_state
        else:
            frontier, order, seen = parent
            scores = (frontier.scores[order][:, None] + values).reshape(-1)
            parents = (frontier.first + order).repeat_interleave(k)
            ancestors, states = seen.repeat_interleave(k, 0), self.states[-1]
        depth = len(self.tokens) + 1
        self.tokens.append(tokens)
        self.parents.append(parents)
        self.scores.append(scores)
        self.depths.append(torch.full((m * k,), depth, dtype=torch.long, device=device))
        first, self.count = self.count, self.count + m * k
        return Frontier(tokens, scores, states, rows, ancestors, first)

    def expand(self, order: torch.Tensor, out: torch.Tensor) -> None:
        """The frontier's nodes `order` were fed to the drafter, which gave `out` (m, H)."""
        self.states.append(out)
        self.expanded += order.shape[0]

    def level(self, levels: int, frontier: Frontier, order: torch.Tensor) -> TreeLevel:
        """What an `expand` policy sees before the next level (this reads values on the host)."""
        scores = torch.cat(self.scores).tolist()
        expanding = frontier.scores[order].tolist()
        parents = torch.cat(self.parents).tolist()
        tokens = torch.cat(self.tokens).tolist()
        path, node = [], frontier.first + int(order[0])
        while node >= 0:
            path.append(node)
            node = parents[node]
        steps = []
        for level, c in enumerate(reversed(path)):  # c was drafted at depth level + 1 by a state of `level`
            row = self._predictor_row(c, level)
            steps.append(DraftStep(level + 1, tokens[c], self.logps[level][row].exp(), self.states[level][row]))
        return TreeLevel(levels, scores, expanding, steps)

    def _predictor_row(self, candidate: int, level: int) -> int:
        """The row, among level `level`'s predicting states, of the state that predicted `candidate`."""
        k = self.tokens[level].shape[0] // self.logps[level].shape[0]
        first = sum(t.shape[0] for t in self.tokens[:level])
        return (candidate - first) // k

    def tree(self, total_tokens: int) -> DraftTree:
        return select_tree(torch.cat(self.tokens), torch.cat(self.parents), torch.cat(self.scores),
                           torch.cat(self.depths), total_tokens)


def lookup_continuation(sequence: list[int], max_tokens: int, min_match: int = 2, max_match: int = 4) -> list[int]:
    """Up to `max_tokens` tokens that followed the latest earlier occurrence of the sequence's last
    `min_match`..`max_match` tokens (the longest such ending wins, then the latest occurrence); []
    when the ending never occurred before."""
    n, last = len(sequence), sequence[-1] if sequence else None
    best, best_len = -1, min_match - 1
    for s in range(n - 2, -1, -1):  # s: where an earlier copy of the ending ends
        if sequence[s] != last:
            continue
        m = 1
        while m < max_match and m <= s and sequence[s - m] == sequence[n - 1 - m]:
            m += 1
        if m > best_len:
            best, best_len = s, m
            if m == max_match:
                break
    return sequence[best + 1: best + 1 + max_tokens] if best >= 0 and max_tokens > 0 else []


def graft(tree: DraftTree, chain: list[int]) -> DraftTree:
    """The tree with `chain` drafted from the root: its tokens follow existing nodes as long as they
    match and continue as new nodes (appended, parents before children) from the first that does not."""
    kids, tokens = tree.children(), tree.tokens.tolist()
    node, shared = -1, 0  # the deepest node the chain shares with the tree, and its depth
    for token in chain:
        match = next((c for c in kids[node + 1] if tokens[c] == token), None)
        if match is None:
            break
        node, shared = match, shared + 1
    rest = chain[shared:]
    if not rest:
        return tree
    n, device = len(tree), tree.tokens.device
    parents = [node] + list(range(n, n + len(rest) - 1))
    score = tree.scores[node] if node >= 0 else torch.zeros((), device=device)
    return DraftTree(tokens=torch.cat([tree.tokens, torch.tensor(rest, dtype=torch.long, device=device)]),
                     parents=torch.cat([tree.parents, torch.tensor(parents, dtype=torch.long, device=device)]),
                     depth=torch.cat([tree.depth, torch.arange(shared + 1, shared + 1 + len(rest), device=device)]),
                     scores=torch.cat([tree.scores, score.float().expand(len(rest))]))


def verify_tree_greedy(tree: DraftTree, target_argmax: torch.Tensor) -> tuple[list[int], int]:
    """Follow the child equal to the target's argmax (n+1,) (row 0: after the root).
    Returns (accepted node indices root-down, the next token)."""
    kids, argmax = tree.children(), target_argmax.tolist()
    tokens = tree.tokens.tolist()
    node, path = -1, []
    while True:
        want = argmax[node + 1]
        match = next((c for c in kids[node + 1] if tokens[c] == want), None)
        if match is None:
            return path, want
        path.append(match)
        node = match


def verify_tree(tree: DraftTree, pi: torch.Tensor, generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Sibling-wise speculative sampling against pi (n+1, V), the target law after the root and
    after every node. Returns (accepted node indices root-down, the next token)."""
    kids, tokens = tree.children(), tree.tokens.tolist()
    node, path = -1, []
    while True:
        p = pi[node + 1].clone()
        accepted = None
        for child in kids[node + 1]:
            x = tokens[child]
            u = float(torch.rand((), generator=generator, device=p.device))
            if u < float(p[x]):
                accepted = child
                break
            p[x] = 0.0
            mass = float(p.sum())
            if mass <= 1e-12:  # p was (numerically) all on x: rejecting it had probability ~0
                accepted = child
                break
            p = p / mass
        if accepted is None:
            return path, int(sample(p, generator))
        path.append(accepted)
        node = accepted
