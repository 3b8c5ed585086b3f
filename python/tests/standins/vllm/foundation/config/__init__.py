"""STAND-IN: the package vllm/foundation/config (vllm-project/vllm @
aedcda890b813c2a68618ce6b7547d2e5881dbde), the new home of vllm.config (which
stays as a shim). The stand-in has only weight_transfer.py here; the other
config classes are in the stand-in's vllm/config."""
