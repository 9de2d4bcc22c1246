"""Device helpers shared by every stage: the batch description of spec §1 read on the device."""
from numba import int32

from ..jit import device_jit


@device_jit
def row_state(i, req_ids, positions, seq_lens, r):
    """Spec §1/§4 for query row ``i``: ``(req, p, nb)``.

    ``req`` is -1 for an inert row (request id out of range, negative position, empty request);
    ``p`` is the clamped position and ``nb`` the number of visible complete groups
    ``min((p + 1) // r, seq_len // r)``. Inert rows return ``(-1, -1, 0)``.
    """
    req = int32(req_ids[i])
    pos = int32(positions[i])
    if req < int32(0) or req >= int32(seq_lens.shape[0]) or pos < int32(0):
        return int32(-1), int32(-1), int32(0)
    slen = int32(seq_lens[req])
    if slen <= int32(0):
        return int32(-1), int32(-1), int32(0)
    p = min(pos, slen - int32(1))
    nb = min((p + int32(1)) // int32(r), slen // int32(r))
    return req, p, nb
