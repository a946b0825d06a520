"""What every role uses: plugins named by path, the trace, weight-update groups, tensors by
reference, process helpers. Imports no role."""
