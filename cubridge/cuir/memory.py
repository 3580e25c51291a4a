"""Memory semantics of the CuIR interpreter: global tiles (zero-filled out-of-range loads,
predicated stores, written-element tracking) and shared memory (the tokens that make a read
before its wait an error, not a wrong number). A mixin of the interpreter class."""
from __future__ import annotations

import math

import torch

from cubridge.cuir.values import BYTES, UNWRITTEN, GTensor, GView, SmemView, round_to


class MemoryMixin:
    def _check_written(self, g: GTensor):
        missing = ~g.written
        if bool(missing.any()):
            n = int(missing.sum())
            first = tuple(int(i) for i in missing.nonzero()[0])
            lines = sorted(g.store_lines)
            self.fail(f"output {g.name}: {n} of {g.written.numel()} elements never written, first at {list(first)}",
                      lines[0] if lines else g.decl_line,
                      f"the stores to {g.name} (lines {lines or 'none'}) must cover every element: "
                      "check the grid extent and the tile bounds")

    def read_smem(self, view: SmemView, ctx, line) -> torch.Tensor:
        buf = view.buf
        for r in view.rows():
            tok = buf.tokens[r]
            if tok is UNWRITTEN:
                self.fail(f"read of shared memory {buf.name}[{r}] that nothing has written", line,
                          "load the tile (copy_async / tma_load / store) before reading it")
            self._check_token(tok, buf, r, ctx, line)
            if ctx.warps > 1:
                ctx.reads[(id(buf), r)] = (ctx.sync_epoch, line)
        idx = tuple(slice(ix[0], ix[1]) if isinstance(ix, tuple) else ix for ix in view.index)
        data = buf.data[(slice(None),) * self.nl + idx]
        if view.transposed:
            data = data.transpose(-1, -2)
        nbytes = math.prod(view.shape) * BYTES[buf.dtype] * self.lane_count
        self.counters.bytes["smem->reg"] += nbytes
        return data

    def _check_token(self, tok, buf, r, ctx, line):
        kind = tok[0]
        if kind == "group":
            _, owner, gid, issue_line = tok
            if owner is not ctx:
                self.fail(f"{ctx.label} reads {buf.name}[{r}], filled by cp.async in {owner.label}", line,
                          "cp.async completes only for the thread that issued it: use tma_load with a "
                          "barrier to hand tiles between roles")
            if gid not in ctx.groups_done:
                self.fail(f"read of {buf.name}[{r}] before its cp.async (line {issue_line}) was waited on",
                          line, "commit_group() after the copies and wait_group(n) before the read")
            if ctx.warps > 1 and ctx.done_epoch.get(gid, -1) >= ctx.sync_epoch:
                self.fail(f"race in {ctx.label} ({ctx.warps} warps): read of {buf.name}[{r}], filled by cp.async "
                          f"(line {issue_line}), with no sync() after its wait_group: each warp waited only "
                          "for its own copies, so rows other warps copied may not have landed", line,
                          "sync() after wait_group(n), before the first read of the tile")
        elif kind == "tma":
            _, bar, phase, issue_line = tok
            if ctx.observed.get(id(bar), -1) < phase:
                self.fail(f"{ctx.label} reads {buf.name}[{r}] before waiting on {bar.name} for the tma_load "
                          f"at line {issue_line} (phase {phase})", line,
                          f"wait({bar.name}, parity) for that phase first; if you did, a producer may have "
                          "overwritten the slot before its release (missing empty-barrier wait)")

    def check_refill(self, view: SmemView, ctx, e):
        """An asynchronous copy into a slot this role read since its last sync(): in a role of several
        warps, any thread may copy any row, so a fast warp refills the slot while slow warps still
        read it (fa2 without the sync() before its cp.async ring refill)."""
        if ctx is None or ctx.warps <= 1:
            return
        for r in view.rows():
            seen = ctx.reads.get((id(view.buf), r))
            if seen is not None and seen[0] == ctx.sync_epoch:
                self.fail(f"race in {ctx.label} ({ctx.warps} warps): {e.op} into {view.buf.name}[{r}] while other "
                          f"warps may still read it (read at line {seen[1]}, no sync() in between)", e.line,
                          f"sync() between the last read of {view.buf.name}[{r}] and its refill")

    def write_smem(self, view: SmemView, value: torch.Tensor, token, line):
        buf = view.buf
        if view.transposed:
            self.fail("cannot write through a transposed view", line)
        idx = (slice(None),) * self.nl + tuple(slice(ix[0], ix[1]) if isinstance(ix, tuple) else ix
                                              for ix in view.index)
        target = buf.data[idx]
        value = self.align(target, value)[1] if isinstance(value, torch.Tensor) else value
        try:
            buf.data[idx] = torch.broadcast_to(value, target.shape)
        except RuntimeError:
            self.fail(f"tile of shape {tuple(value.shape[self.nl:])} does not fit {buf.name} view "
                      f"{view.shape}", line)
        for r in view.rows():
            buf.tokens[r] = token

    def gmem_index(self, view: GView, line):
        """Torch index for a global view, clipped to bounds; plus per-slice (extent, valid)."""
        g = view.g
        idx, slices, adv = [], [], []
        for d, it in enumerate(view.index):
            n = g.data.shape[d]
            if isinstance(it, tuple):
                lo, hi = it
                if lo < 0 or hi < lo:
                    self.fail(f"bad slice {lo}:{hi} of {g.name} dim {d}", line)
                top = min(hi, n)
                idx.append(slice(min(lo, n), max(top, min(lo, n))))
                slices.append((hi - lo, max(0, top - lo)))
            else:
                t = self.as_lane_scalar(it)
                if t.dtype.is_floating_point:
                    self.fail(f"index of {g.name} dim {d} is not an integer", line)
                if bool((t < 0).any()) or bool((t >= n).any()):
                    self.fail(f"index out of range for {g.name} dim {d} of size {n}", line)
                idx.append(t)
                adv.append(d)
        if not adv:
            return None, slices
        contiguous = adv == list(range(adv[0], adv[0] + len(adv)))
        return (tuple(idx), adv[0] if contiguous else 0), slices

    def gmem_load(self, view: GView, line) -> torch.Tensor:
        g = view.g
        spec, slices = self.gmem_index(view, line)
        if spec is None:
            data = self.lanes(g.data[tuple(slice(*s) for s in _slice_items(view))])
        else:
            idx, pos = spec
            data = g.data[idx]
            if pos:
                data = data.movedim(tuple(range(pos, pos + self.nl)), tuple(range(self.nl)))
        pads = []
        for extent, valid in reversed(slices):
            pads += [0, extent - valid]
        if any(pads):
            data = torch.nn.functional.pad(data, pads, value=0)
        return data

    def gmem_store(self, view: GView, value, line):
        g = view.g
        if not g.is_output:
            self.fail(f"store into input {g.name}", line, "inputs are read-only; declare a global_output")
        spec, slices = self.gmem_index(view, line)
        shape = tuple(e for e, _ in slices)
        value = self._fit(value, shape, g.name, line)
        value = round_to(value, g.dtype)
        crop = (slice(None),) * self.nl + tuple(slice(0, v) for _, v in slices)
        value = value[crop]
        if spec is None:
            if any(n != 1 for n in value.shape[: self.nl]):
                self.fail(f"store into {g.name} with no per-block index: every block run together "
                          "would write the same elements", line, "index the store with the block indices")
            sl = tuple(slice(*s) for s in _slice_items(view))
            g.data[sl] = value.reshape(value.shape[self.nl:])
            g.written[sl] = True
            self.counters.bytes["reg->gmem"] += value.numel() * BYTES[g.dtype]
        else:
            idx, pos = spec
            adv_shape = torch.broadcast_shapes(*(t.shape for t in idx if isinstance(t, torch.Tensor)))
            value = value.expand(tuple(adv_shape) + tuple(value.shape[self.nl:]))
            if pos:
                value = value.movedim(tuple(range(self.nl)), tuple(range(pos, pos + self.nl)))
            g.data[idx] = value
            g.written[idx] = True
            self.counters.bytes["reg->gmem"] += value.numel() * BYTES[g.dtype]
        g.store_lines.add(line)

    def _fit(self, value, shape, name, line) -> torch.Tensor:
        if not isinstance(value, torch.Tensor):
            value = self.lanes(torch.full(shape, float(value)))
        tile = tuple(value.shape[self.nl:])
        squeezed = tile
        while len(squeezed) > len(shape) and squeezed[-1] == 1:
            squeezed = squeezed[:-1]
        if squeezed != tuple(shape) and not (len(squeezed) == len(shape) and
                                             all(a in (1, b) for a, b in zip(squeezed, shape))):
            self.fail(f"tile of shape {tile} does not match the {name} view of shape {tuple(shape)}", line)
        value = value.reshape(value.shape[: self.nl] + squeezed)
        return value.expand(value.shape[: self.nl] + tuple(shape))




def _slice_items(view: GView):
    return [(it[0], min(it[1], view.g.data.shape[d])) for d, it in enumerate(view.index)]
