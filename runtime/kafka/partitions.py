"""What a service plugs into :class:`~hsx.runtime.kafka.member.GroupMember`:
what it does when partitions come and go, and how the member commits."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from hsx.runtime.kafka.watermarks import TopicPartitionKey

Commit = Callable[[set[TopicPartitionKey] | None], None]
"""Commits the watermarks (optionally of some partitions only)."""


class PartitionHandler(Protocol):
    """What a service does when partitions come and go."""

    def assigned(self, partitions: list[TopicPartitionKey]) -> None:
        """Set up per-partition state (runs before the first record arrives)."""

    def revoked(self, partitions: list[TopicPartitionKey]) -> None:
        """Make the partitions' finished work durable and drop their state; the
        member commits right after, while the partitions are still ours."""

    def lost(self, partitions: list[TopicPartitionKey]) -> None:
        """Drop the partitions' state: another member owns them already."""


class Stateless:
    """The handler of a service that keeps no per-partition state."""

    def assigned(self, partitions: list[TopicPartitionKey]) -> None:
        pass

    revoked = lost = assigned
