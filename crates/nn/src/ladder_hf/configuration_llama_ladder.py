# Written by ferrolm beside every Ladder Transformer checkpoint, so that
#   AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)
# loads it. A Ladder model is a Llama whose chosen layers read the residual stream one branch
# late (Ladder Residual, arXiv 2501.06589); its config is a Llama config plus `ladder_layers`.
from transformers import LlamaConfig


class LlamaLadderConfig(LlamaConfig):
    """A Llama config plus `ladder_layers`: an int N (the last N layers are Ladder layers), a
    list of layer indices, or None (a plain Llama)."""

    model_type = "llamaLadder"

    def __init__(self, ladder_layers=None, **kwargs):
        self.ladder_layers = ladder_layers
        super().__init__(**kwargs)

    def ladder_indices(self):
        """The set of Ladder layer indices `ladder_layers` denotes."""
        n, spec = self.num_hidden_layers, self.ladder_layers
        if spec is None:
            return frozenset()
        if isinstance(spec, bool):
            raise ValueError(f"ladder_layers must be an int, a list or null, not {spec!r}")
        if isinstance(spec, int):
            if not 0 <= spec <= n:
                raise ValueError(f"ladder_layers {spec} is outside 0..={n}")
            return frozenset(range(n - spec, n))
        if isinstance(spec, (list, tuple)):
            if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n for i in spec) or len(set(spec)) != len(spec):
                raise ValueError(f"ladder_layers {spec}: entries must be distinct layer indices < {n}")
            return frozenset(spec)
        raise ValueError(f"ladder_layers must be an int, a list or null, not {spec!r}")
