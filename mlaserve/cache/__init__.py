"""The cache room: the tensors every layer's declared states need (model_cache.py) and the page
bookkeeping of the scheduling rank (page_pool.py). What each layer keeps is declared in
config/layer_kinds.py."""
