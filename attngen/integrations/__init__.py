"""attngen inside other libraries: each module here plugs attngen's kernels into one (`transformers`: Hugging Face
transformers' attention interface). A layer above the API; nothing in attngen imports it."""
