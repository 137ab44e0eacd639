"""RL data: preprocessors (`preprocess`), the synthetic arithmetic task (`synthetic`), the builtin
tokenizer (`tokenizer`, `build_tokenizer`), prompt datasets and loaders (`dataset`), padding helpers.

Submodules are imported explicitly (`from megarl.data.dataset import RLDataset`) so that
`megarl preprocess` does not pay for torch or transformers.
"""
