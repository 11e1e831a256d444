"""Which key a route needs: --api-key for generation and reads, --admin-api-key for the control routes
(SGLang's ADMIN_OPTIONAL level, on the routes of ADMIN_PATHS):

    keys set                  generation and read routes     control routes
    none                      open                           open
    --api-key                 the API key                    the API key
    --admin-api-key           open                           the admin key
    both                      the API key                    the admin key (the API key is refused)

A key comes as `Authorization: Bearer <key>` or `x-api-key: <key>` and is compared in constant time.
/health and /metrics are always open (probes and scrapers carry no key).
"""
from __future__ import annotations

import hmac
from typing import Mapping, Optional

OPEN_PATHS = frozenset({"/health", "/metrics"})

# The control routes, by SGLang's names, whoever serves them: a route registered under one of these
# paths needs the admin key once --admin-api-key is set. Sessions are not here: a client opens its own.
ADMIN_PATHS = frozenset({
    # weights
    "/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed",
    "/destroy_weights_update_group", "/update_weights_from_tensor", "/update_weights_from_ipc",
    "/get_weights_by_name", "/update_weight_version",
    # LoRA adapters
    "/load_lora_adapter", "/unload_lora_adapter",
    # generation and memory
    "/pause_generation", "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation",
    "/flush_cache", "/drain",
    # diagnostics and knobs
    "/start_profile", "/stop_profile", "/slow_down", "/set_internal_state", "/freeze_gc",
})


def sent_key(headers: Mapping[str, str]) -> str:
    sent = headers.get("authorization", "")
    return sent[7:] if sent.lower().startswith("bearer ") else headers.get("x-api-key", "")


def required_key(path: str, api_key: Optional[str], admin_api_key: Optional[str]) -> Optional[str]:
    """The key a request to `path` must carry; None: the route is open."""
    if path in OPEN_PATHS:
        return None
    if path in ADMIN_PATHS and admin_api_key:
        return admin_api_key
    return api_key or None


def refusal(path: str, headers: Mapping[str, str], api_key: Optional[str],
            admin_api_key: Optional[str]) -> Optional[str]:
    """Why a request is refused (a 401), or None."""
    key = required_key(path, api_key, admin_api_key)
    if key is None or hmac.compare_digest(sent_key(headers).encode(), key.encode()):
        return None
    if key == admin_api_key and path in ADMIN_PATHS:
        return "invalid or missing admin API key (--admin-api-key): this is a control route"
    return "invalid or missing API key"
