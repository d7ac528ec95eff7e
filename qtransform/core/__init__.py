"""The core layer: sites, module graphs, graph insertion, programs, capture, custom ops, metrics,
noise schedules and file writing. Depends only on `qtransform.formats` and `qtransform.errors`."""
