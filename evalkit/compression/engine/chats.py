"""Chats through the engine (:meth:`Engine.run_chats`): each chat's turns follow one another in one slot while other
chats decode beside it, with the answers :func:`evalkit.compression.generate_shared` gives (``mode="multi_turn"``).

A turn ends (EOS, its limit, a stop string) with its slot holding the conversation so far, its answer fed back but
the last token. The slot is then parked: nothing decodes in it, and its next turn takes it before any other request.
That turn's tokens (the last answer's last token, or the gold answer, then the user's ids, an end-of-turn token fed
once) are prefilled on top as a session's tokens are: under ``history=own`` the slot's row is copied back into the
session the turn was admitted from (:mod:`.slot_snapshot`); under ``history=gold`` that session, kept as it was
before the answer (the model answered on the slot's copy of it), continues with the gold answer instead. The next
turn is then a request over that session (``Request(prefix=)``), moved into the slot as a query over a shared context
is. Per method, what ``generate_shared`` documents holds: the context is compressed once, turns are appended (a
method that evicts while decoding keeps its one size).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .request import Chat, Completion, Request, Resident
from .slot_pool import SlotPool, slots_needed
from .slot_snapshot import copy_slot_into


class ChatRun:
    """One run of ``chats``: which turn each engine request is, and the request that follows each finished one."""

    def __init__(self, chats: list[Chat], pool: SlotPool, eos: torch.Tensor | None,
                 on_chat: Callable[[int, list[Completion]], None] | None = None):
        self.chats, self.pool, self.on_chat = chats, pool, on_chat
        self.eos = set(eos.tolist()) if eos is not None else set()
        # each turn's request (by identity, kept alive here) -> (chat, turn)
        self.turn_of = {id(chat.turns[0]): (index, 0, chat.turns[0]) for index, chat in enumerate(chats)}
        self.answers: list[list[Completion]] = [[] for _ in chats]

    def first_turns(self) -> list[Request]:
        return [chat.turns[0] for chat in self.chats]

    def slot_tokens(self) -> int:
        return chat_slot_tokens(self.pool.model.config, self.pool.policy, self.chats)

    def follow(self, slot: int, resident: Resident, completion: Completion) -> Request | None:
        """The request of the turn after ``completion``'s (None: its chat is done, handed to ``on_chat``)."""
        chat_index, turn, _ = self.turn_of.pop(id(resident.request))
        chat, session = self.chats[chat_index], resident.session
        self.answers[chat_index].append(completion)
        resident.session = None
        if turn + 1 == len(chat.turns):
            if self.on_chat is not None:
                self.on_chat(chat_index, self.answers[chat_index])
            return None
        if chat.gold is None:  # the model's own answer stays: the slot as the turn left it
            copy_slot_into(self.pool, slot, session, max(len(completion.tokens) - 1, 0))
            pending = torch.tensor(completion.tokens[-1:], dtype=torch.long)
        else:  # the conversation as it was before the answer, then the gold answer
            pending = chat.gold[turn]
        following = chat.turns[turn + 1]
        query = following.input_ids
        if len(pending) and int(pending[-1]) in self.eos and int(query[0]) == int(pending[-1]):
            query = query[1:]  # the template writes the end of turn the answer ended with: fed once
        request = dataclasses.replace(following, input_ids=torch.cat([pending, query]), prefix=session)
        self.turn_of[id(request)] = (chat_index, turn + 1, request)
        return request


def chat_slot_tokens(config, policy, chats: list[Chat]) -> int:
    """The slots a growing ``policy`` needs for the longest of ``chats``: its first turn's, then every later turn's
    tokens and answer (the fed tokens at most the user's ids and the last answer's last token, or the gold answer).
    What :meth:`Engine.run_chats` reserves by default; a run that spreads its chats over several engines hands each
    the whole run's."""

    def needed(chat: Chat) -> int:
        later = sum(turn.input_ids.numel() + turn.max_new_tokens for turn in chat.turns[1:])
        pending = sum(len(answer) for answer in chat.gold[:-1]) if chat.gold is not None else len(chat.turns) - 1
        return slots_needed(config, policy, chat.turns[0]) + later + pending

    return max(needed(chat) for chat in chats)
