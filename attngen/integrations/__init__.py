"""attngen inside other libraries: each module here plugs attngen's kernels into one (`transformers`: Hugging Face
transformers' attention interface; `torch_flash`: PyTorch's flash-attention provider slot). A layer above the API;
only the facade (attngen/__init__.py) imports one, `torch_flash`, to register it with torch."""
