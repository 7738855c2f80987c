"""The KV cache, as plain pieces both the models and the engine build on (neither the other):
the kinds of attention cache and their block managers (kinds/), how layers group into a layout
(layout), the block pool with the prefix cache's index (block_pool), and the paged tensors (paged).
The engine's BlockManager coordinates them per sequence; a model family names its cache class."""
