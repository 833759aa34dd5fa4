"""Speculative decoding's proposers that run on the host (n-gram prompt lookup). The draft model
runs on the device beside the step (`jaxserve.worker.draft`)."""
