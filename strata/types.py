"""Identifiers shared by every layer."""

from __future__ import annotations

from typing import NewType

RequestId = NewType("RequestId", str)
SessionId = NewType("SessionId", str)
InstanceId = NewType("InstanceId", str)
ModelVersion = NewType("ModelVersion", str)
BlockHash = NewType("BlockHash", bytes)
TokenIds = list[int]

__all__ = ["BlockHash", "InstanceId", "ModelVersion", "RequestId", "SessionId", "TokenIds"]
