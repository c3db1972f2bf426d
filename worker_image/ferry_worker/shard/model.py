"""The sizes of a decoder-only model, read from config.json the way vLLM reads them."""
from __future__ import annotations

from dataclasses import dataclass, field

from .layouts import Family

# vLLM pads the vocabulary of VocabParallelEmbedding / ParallelLMHead to this
# multiple (vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE) before
# splitting it across ranks. LoRA adapters change it; Ferry does not shard for LoRA.
VOCAB_PADDING = 64


class ShardError(ValueError):
    """The checkpoint cannot be cut for the requested target; nothing is written."""


def pad_vocab(vocab: int) -> int:
    return -(-vocab // VOCAB_PADDING) * VOCAB_PADDING


@dataclass(frozen=True)
class ModelDims:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    layers: int
    tie_word_embeddings: bool
    # The family's own sizes (`Family.sizes`): experts, moe_intermediate, ...
    extra: tuple[tuple[str, int], ...] = field(default=())

    @classmethod
    def from_config(cls, family: Family, config: dict) -> "ModelDims":
        def required(key: str, default: int | None = None) -> int:
            value = config.get(key)
            if value in (None, 0) and default is not None:  # vLLM reads these as `config.x or default`
                return default
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ShardError(f"config.json: {key} must be a positive integer, got {value!r}")
            return value

        hidden, heads = required("hidden_size"), required("num_attention_heads")
        # vLLM: `head_dim or hidden_size // num_attention_heads`
        head_dim = hidden // heads
        if family.head_dim_from_config:
            head_dim = required("head_dim", default=head_dim)
        if head_dim < 1:
            raise ShardError(f"config.json: hidden_size {hidden} // num_attention_heads {heads} leaves head_dim 0")
        kv_heads = required("num_key_value_heads", default=heads)
        extra = {}
        for size in family.sizes:
            key = next((k for k in size.keys if config.get(k) is not None), size.keys[0])
            extra[size.symbol] = 0 if size.optional and config.get(key) is None else required(key)
        if family.derived_sizes is not None:
            common = {"hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim}
            extra |= family.derived_sizes(common | extra)
        return cls(
            hidden=hidden,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate=required("intermediate_size"),
            vocab=required("vocab_size"),
            layers=required("num_hidden_layers"),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", family.tied_by_default)),
            extra=tuple(extra.items()),
        )

    def size(self, symbol: str) -> int:
        """The length of a symbolic dimension used in the layout tables (`a+b`: a sum)."""
        if "+" in symbol:
            return sum(self.size(part) for part in symbol.split("+"))
        if symbol.isdigit():  # a literal extent (a packed tensor's recorded [2] shape)
            return int(symbol)
        extra = dict(self.extra)
        if symbol in extra:
            return extra[symbol]
        return {
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "vocab": self.vocab,
            "head_dim": self.head_dim,
            "q": self.heads * self.head_dim,
            "kv": self.kv_heads * self.head_dim,
        }[symbol]

    def shape(self, symbols: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(self.size(s) for s in symbols)

    @property
    def experts(self) -> int:
        """Routed experts per MoE layer; 0 for a dense model."""
        return dict(self.extra).get("experts", 0)

    def check_tensor_parallel(self, tp: int, *, dense_mlp: bool = True) -> None:
        """Refuse a TP size vLLM itself would assert on (QKVParallelLinear,
        LlamaAttention, VocabParallelEmbedding all use `divide`). `dense_mlp`:
        whether any layer has a dense MLP cut by `intermediate`."""
        problems = []
        if self.heads % tp:
            problems.append(f"{self.heads} attention heads")
        if tp >= self.kv_heads and tp % self.kv_heads:
            problems.append(f"{self.kv_heads} KV heads (TP above the KV head count must be a multiple of it)")
        if tp < self.kv_heads and self.kv_heads % tp:
            problems.append(f"{self.kv_heads} KV heads")
        if dense_mlp and self.intermediate % tp:
            problems.append(f"intermediate size {self.intermediate}")
        if pad_vocab(self.vocab) % tp:
            problems.append(f"padded vocabulary {pad_vocab(self.vocab)}")
        if problems:
            raise ShardError(f"tensor parallel size {tp} does not divide: {'; '.join(problems)}")


def pp_layer_ranges(layers: int, pp: int, partition: list[int] | None = None) -> list[tuple[int, int]]:
    """[start, end) of the decoder layers of each pipeline stage, as vLLM's
    `distributed/utils.get_pp_indices` computes them: an explicit partition
    (its VLLM_PP_LAYER_PARTITION), or an even split whose remainder goes to the
    stages before the last, counting back from the second-to-last."""
    if partition is None and pp > layers:  # before a list of `pp` sizes is built
        raise ShardError(f"pipeline parallel size {pp} leaves a stage without layers ({layers} layers)")
    if partition is not None:
        if len(partition) != pp or sum(partition) != layers or min(partition) < 0:
            raise ShardError(f"layer partition {partition} must have {pp} entries summing to {layers}")
        sizes = list(partition)
    else:
        sizes = [layers // pp] * pp
        for i in range(2, layers % pp + 2):
            sizes[-i] += 1
    if 0 in sizes:
        raise ShardError(f"pipeline parallel size {pp} leaves a stage without layers ({sizes}; {layers} layers)")
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [(start, start + size) for start, size in zip(starts, sizes)]
