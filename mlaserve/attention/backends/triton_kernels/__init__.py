"""The Triton kernels of the `triton` attention backend (attention/backends/triton_backend.py): latent MQA over the
paged cache, dense or over each query's selected rows (latent_mqa.py), and the DSA indexer's scores
(index_scores.py). Triton reads TRITON_INTERPRET when a kernel is defined, so these modules are imported only by
the backend's first call, after the engine checked how Triton runs on the device (platform/triton_runtime.py)."""
