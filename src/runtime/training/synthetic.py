"""A synthetic PCVR data set, deterministic by seed, with a planted signal the models can learn.

A hidden "world" (drawn from the seed) gives every item a category, every category a unit latent
vector, every item a quality, and every sparse-field value and dense feature an effect. A user has
1-3 preferred categories; most history events fall in them, and a conversion is likelier when the
target's category is close to the action- and recency-weighted categories of the history:

    logit = 3 <history latent, target category latent> + quality[target] + sparse effects + dense . w + bias

Every batch is a pure function of (seed, stream, batch index, batch size): resuming at a step, or
giving each DDP rank its own indices, needs no state beyond the index.

Each example carries a user id in [1, n_users], drawn after everything else and independent of it: it groups the
validation examples for GAUC (the planted signal has no per-user part, so GAUC stays close to AUC).

jagged=True makes another data set from the same world: history lengths skewed short (a half-normal in log length
from min(16, seq_len), histories longer than seq_len cut to it, as a truncated log), event timestamps (int64
seconds: a start within a month of a fixed epoch, then lognormal gaps of median ten minutes with a heavy tail, so
strictly increasing), and batches packed without padding (PCVRBatch.seq_offsets, max_seqlen). jagged=False draws
exactly the padded batches it always drew (lengths uniform in [seq_len // 8, seq_len], no timestamps).
"""

from __future__ import annotations

import math

import torch

from runtime.models import FeatureSpec, PCVRBatch
from runtime.models.inputs import offsets_of, pack_histories

LATENT_DIM = 8
AFFINITY_SCALE = 3.0
RECENCY_TAU = 64.0  # history events lose weight with age (in events) on this scale
ACTION_PROBS = (0.7, 0.2, 0.1)  # click, add-to-cart, purchase
ACTION_WEIGHTS = (0.0, 1.0, 2.0, 4.0)  # by action id; 0 is padding
PREFERRED_SHARE = 0.75  # history events drawn from the user's preferred categories
TARGET_PREFERRED_SHARE = 0.5
# name, vocabulary size, effect scale, ids per example (1: single-valued; >1: a bag of 1..that many)
SPARSE_FIELDS = (
    ("user_segment", 1000, 0.3, 1),
    ("region", 100, 0.4, 1),
    ("device", 8, 0.4, 1),
    ("interest_tags", 256, 0.5, 4),
)
TABLE_EFFECT = 0.15  # the effect scale of each generated field (sparse_tables > 0)
VAL_BLOCK = 1024  # the validation set is made in blocks of this size, whatever the batch size
JAGGED_MIN_LENGTH = 16  # the shortest jagged history (or seq_len, if shorter)
JAGGED_LOG_SPREAD = 0.5  # the half-normal's scale in log length, as a share of log(seq_len / shortest)
EPOCH_S = 1_700_000_000  # the first user's history starts within START_SPREAD_S after this
START_SPREAD_S = 30 * 86400
GAP_MEDIAN_S, GAP_LOG_SIGMA = 600.0, 2.0  # gaps between events: lognormal seconds, at least 1

_STREAMS = {"world": 0, "train": 1, "val": 2}


def _stream_seed(seed: int, stream: str, index: int = 0) -> int:
    return (seed * 0x9E3779B1 + _STREAMS[stream] * 0x85EBCA77 + index * 0xC2B2AE3D) % (2**63 - 1)


class SyntheticPCVR:
    """train_batch(index, batch_size) -> PCVRBatch; val_set() -> the fixed validation PCVRBatch."""

    def __init__(
        self,
        seed: int = 0,
        seq_len: int = 256,
        n_items: int = 20000,
        n_categories: int = 64,
        n_dense: int = 8,
        val_size: int = 8192,
        sparse_tables: int = 0,
        sparse_vocab: int = 1_000_000,
        sparse_hotness: int = 4,
        n_users: int = 1000,
        jagged: bool = False,
    ) -> None:
        if seq_len < 1 or n_items < n_categories or n_categories < 1 or n_dense < 1 or val_size < 1 or n_users < 1:
            raise ValueError(
                f"synthetic data: expected seq_len >= 1, n_items >= n_categories >= 1, n_dense >= 1, val_size >= 1 and "
                f"n_users >= 1, got seq_len={seq_len}, n_items={n_items}, n_categories={n_categories}, n_dense={n_dense}, "
                f"val_size={val_size}, n_users={n_users}"
            )
        if sparse_tables < 0 or sparse_vocab < 1 or sparse_hotness < 1:
            raise ValueError(
                f"synthetic data: expected sparse_tables >= 0, sparse_vocab >= 1 and sparse_hotness >= 1, got "
                f"sparse_tables={sparse_tables}, sparse_vocab={sparse_vocab}, sparse_hotness={sparse_hotness}"
            )
        self.seed = seed
        self.jagged = jagged
        self.n_users = n_users
        self.val_size = val_size
        # sparse_tables > 0: that many multi-hot fields of sparse_vocab ids (bags of 1..sparse_hotness), else the four
        # built-in fields
        self.fields = SPARSE_FIELDS
        if sparse_tables:
            self.fields = tuple(
                (f"sparse_{i:02d}", sparse_vocab, TABLE_EFFECT, sparse_hotness) for i in range(sparse_tables)
            )
        hotness = max(h for *_, h in self.fields)
        self.spec = FeatureSpec(
            n_items=n_items,
            n_categories=n_categories,
            n_actions=len(ACTION_PROBS),
            sparse_fields={name: vocab for name, vocab, *_ in self.fields},
            sparse_hotness=hotness,
            n_dense=n_dense,
            seq_len=seq_len,
        )
        self._make_world(torch.Generator().manual_seed(_stream_seed(seed, "world")))
        self._val: PCVRBatch | None = None

    def _make_world(self, gen: torch.Generator) -> None:
        spec = self.spec
        category = torch.randint(1, spec.n_categories + 1, (spec.n_items + 1,), generator=gen)
        category[1 : spec.n_categories + 1] = torch.arange(1, spec.n_categories + 1)  # no empty category
        category[0] = 0
        self.item_category = category
        self.items_by_category = torch.argsort(category[1:], stable=True) + 1
        counts = torch.bincount(category[1:], minlength=spec.n_categories + 1)
        self.category_count = counts
        self.category_start = torch.cumsum(counts, 0) - counts
        latent = torch.randn(spec.n_categories + 1, LATENT_DIM, generator=gen)
        self.category_latent = latent / latent.norm(dim=-1, keepdim=True)
        self.item_quality = 0.5 * torch.randn(spec.n_items + 1, generator=gen)
        self.field_effects = [scale * torch.randn(vocab + 1, generator=gen) for _, vocab, scale, _ in self.fields]
        self.dense_weight = 0.3 * torch.randn(spec.n_dense, generator=gen)
        self.bias = -1.5

    # ------------------------------------------------------------------ sampling

    def _items_in(self, categories: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """A uniformly random item of each given category."""
        u = torch.rand(categories.shape, generator=gen)
        offset = (u * self.category_count[categories]).long()
        return self.items_by_category[self.category_start[categories] + offset]

    def generate(self, n: int, gen: torch.Generator) -> tuple[PCVRBatch, torch.Tensor]:
        """n examples and their true conversion logits."""
        spec, length = self.spec, self.spec.seq_len
        n_cat = spec.n_categories
        n_pref = torch.randint(1, 4, (n, 1), generator=gen)
        preferred = torch.randint(1, n_cat + 1, (n, 3), generator=gen)

        def pick_category(shape: tuple[int, ...], share: float) -> torch.Tensor:
            slot = (torch.rand(shape, generator=gen) * n_pref.view(n, *[1] * (len(shape) - 1))).long()
            own = torch.gather(preferred, 1, slot.view(n, -1)).view(shape)
            other = torch.randint(1, n_cat + 1, shape, generator=gen)
            return torch.where(torch.rand(shape, generator=gen) < share, own, other)

        seq_lengths = (
            self._jagged_lengths(n, gen)
            if self.jagged
            else torch.randint(max(1, length // 8), length + 1, (n,), generator=gen)
        )
        valid = torch.arange(length)[None] < seq_lengths[:, None]
        seq_categories = pick_category((n, length), PREFERRED_SHARE) * valid
        seq_items = self._items_in(seq_categories, gen) * valid
        actions = (
            torch.multinomial(torch.tensor(ACTION_PROBS), n * length, replacement=True, generator=gen).view(n, length)
            + 1
        )
        seq_actions = actions * valid
        target_category = pick_category((n,), TARGET_PREFERRED_SHARE)
        target_item = self._items_in(target_category, gen)

        sparse = torch.zeros(n, len(self.fields), spec.sparse_hotness, dtype=torch.long)
        for f, (_, vocab, _, hot) in enumerate(self.fields):
            ids = torch.randint(1, vocab + 1, (n, hot), generator=gen)
            count = torch.randint(1, hot + 1, (n, 1), generator=gen)
            sparse[:, f, :hot] = ids * (torch.arange(hot)[None] < count)
        dense = torch.randn(n, spec.n_dense, generator=gen)

        # the planted signal
        age = (seq_lengths[:, None] - 1 - torch.arange(length)[None]).clamp(min=0)
        weight = torch.tensor(ACTION_WEIGHTS)[seq_actions] * torch.exp(-age / RECENCY_TAU) * valid
        history = (weight[..., None] * self.category_latent[seq_categories]).sum(1) / weight.sum(1, keepdim=True)
        affinity = (history * self.category_latent[target_category]).sum(-1)
        logit = AFFINITY_SCALE * affinity + self.item_quality[target_item] + dense @ self.dense_weight + self.bias
        for f, effects in enumerate(self.field_effects):
            ids = sparse[:, f]
            present = (ids > 0).float()
            logit = logit + (effects[ids] * present).sum(-1) / present.sum(-1)
        label = torch.bernoulli(torch.sigmoid(logit), generator=gen)
        user_id = torch.randint(1, self.n_users + 1, (n,), generator=gen)
        if self.jagged:
            timestamps = self._timestamps(seq_lengths, gen)
            batch = PCVRBatch(
                sparse=sparse,
                dense=dense,
                seq_items=pack_histories(seq_items, seq_lengths),
                seq_categories=pack_histories(seq_categories, seq_lengths),
                seq_actions=pack_histories(seq_actions, seq_lengths),
                seq_lengths=seq_lengths,
                target_item=target_item,
                target_category=target_category,
                label=label,
                user_id=user_id,
                seq_timestamps=timestamps,
                seq_offsets=offsets_of(seq_lengths),
                max_seqlen=int(seq_lengths.max()),
            )
            return batch, logit

        batch = PCVRBatch(
            sparse=sparse,
            dense=dense,
            seq_items=seq_items,
            seq_categories=seq_categories,
            seq_actions=seq_actions,
            seq_lengths=seq_lengths,
            target_item=target_item,
            target_category=target_category,
            label=label,
            user_id=user_id,
        )
        return batch, logit

    def _jagged_lengths(self, n: int, gen: torch.Generator) -> torch.Tensor:
        """History lengths in [min(16, seq_len), seq_len], most near the shortest: exp of a half-normal in log length
        from the shortest, longer histories cut to seq_len (about one in twenty)."""
        length = self.spec.seq_len
        shortest = min(JAGGED_MIN_LENGTH, length)
        spread = JAGGED_LOG_SPREAD * math.log(length / shortest)
        log_length = math.log(shortest) + spread * torch.randn(n, generator=gen, dtype=torch.float64).abs()
        return log_length.exp().floor().long().clamp(shortest, length)

    def _timestamps(self, lengths: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
        """[total] int64 seconds, strictly increasing within each history (packed, oldest first)."""
        total = int(lengths.sum())
        start = EPOCH_S + torch.randint(0, START_SPREAD_S, (lengths.shape[0],), generator=gen)
        gaps = (math.log(GAP_MEDIAN_S) + GAP_LOG_SIGMA * torch.randn(total, generator=gen, dtype=torch.float64)).exp()
        gaps = gaps.floor().long().clamp_min(1)
        offsets = offsets_of(lengths).long()
        owner = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths, output_size=total)
        running = gaps.cumsum(0)
        # each history's running sum of its own gaps: the first event lands one gap after the history's start
        before = torch.cat([running.new_zeros(1), running])[offsets[:-1]]
        return start[owner] + running - before[owner]

    # ------------------------------------------------------------------ the data interface

    def train_batch(self, index: int, batch_size: int) -> PCVRBatch:
        gen = torch.Generator().manual_seed(_stream_seed(self.seed, "train", index))
        return self.generate(batch_size, gen)[0]

    def val_set(self) -> PCVRBatch:
        if self._val is None:
            self._val, _ = self.val_set_with_logits()
        return self._val

    def val_set_with_logits(self) -> tuple[PCVRBatch, torch.Tensor]:
        """The validation examples and their true logits (the best any model can do)."""
        blocks = []
        for i in range(math.ceil(self.val_size / VAL_BLOCK)):
            gen = torch.Generator().manual_seed(_stream_seed(self.seed, "val", i))
            blocks.append(self.generate(VAL_BLOCK, gen))
        batch = PCVRBatch.concat([b for b, _ in blocks]).slice(0, self.val_size)
        return batch, torch.cat([logit for _, logit in blocks])[: self.val_size]
