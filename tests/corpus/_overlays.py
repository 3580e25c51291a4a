"""The mask functions of transformers' masking_utils, in the project's words: the causal mask, the
sliding-window and chunked overlays, padding and packed-sequence masks, combined with
FlexAttention's and_masks as transformers combines them."""


def causal_mask_function(batch_idx, head_idx, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window_overlay(sliding_window):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx > q_idx - sliding_window
    return inner_mask


def chunked_overlay(chunk_size):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return kv_idx // chunk_size == q_idx // chunk_size
    return inner_mask


def padding_mask_function(padding_mask):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return padding_mask[batch_idx, kv_idx]
    return inner_mask


def packed_sequence_mask_function(packed_sequence_mask):
    def inner_mask(batch_idx, head_idx, q_idx, kv_idx):
        return packed_sequence_mask[batch_idx, q_idx] == packed_sequence_mask[batch_idx, kv_idx]
    return inner_mask
