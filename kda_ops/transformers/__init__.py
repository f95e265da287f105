"""Kimi Linear in Hugging Face transformers, with every KDA layer through kda_ops:

    from kda_ops.transformers import KDACache
    model.generate(input_ids, cache=KDACache(model), prompt_lookup_num_tokens=4)

docs/integration.md#10-hugging-face-transformers. This subpackage imports
transformers (`pip install 'kda_ops[transformers]'`); `import kda_ops` does not.
"""

try:
    import transformers  # noqa: F401
except ImportError as error:
    raise ImportError("kda_ops.transformers needs transformers: pip install "
                      "'kda_ops[transformers]'") from error

from .cache import KDACache

__all__ = ["KDACache"]
