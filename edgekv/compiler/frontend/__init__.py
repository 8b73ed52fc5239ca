"""Graph in and out: the torch export of a model's plain forward (``export.py``), an ONNX file's
graph and weights (``onnx_import.py``, ``onnx_model.py``) and the ONNX export (``onnx_export.py``)."""
