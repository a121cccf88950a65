"""Identifiers and small vocabularies shared by every layer."""

from __future__ import annotations

import enum
from typing import NewType

RequestId = NewType("RequestId", str)
SessionId = NewType("SessionId", str)
InstanceId = NewType("InstanceId", str)
ModelVersion = NewType("ModelVersion", str)
BlockHash = NewType("BlockHash", bytes)
TokenIds = list[int]


class PriorityClass(enum.IntEnum):
    """Request priority classes and their integer values: higher = more important, at the API,
    in the gateway and in the engine (GIE's polarity). An integer priority falls in the class
    of the highest value it reaches; anything below BATCH is SHEDDABLE."""

    SHEDDABLE = -20
    BATCH = -10
    STANDARD = 0
    INTERACTIVE = 10

    @classmethod
    def of(cls, priority: int) -> PriorityClass:
        for klass in (cls.INTERACTIVE, cls.STANDARD, cls.BATCH):
            if priority >= klass:
                return klass
        return cls.SHEDDABLE

    @property
    def label(self) -> str:
        return self.name.lower()


__all__ = ["BlockHash", "InstanceId", "ModelVersion", "PriorityClass", "RequestId", "SessionId",
           "TokenIds"]
