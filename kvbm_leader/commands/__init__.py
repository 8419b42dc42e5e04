"""Leader-initiated commands to workers (G2->G3 demotions): one interface, two transports."""
from .base import CommandAck, CommandTransport, create, register

__all__ = ["CommandAck", "CommandTransport", "create", "register"]
