"""The job's sandbox: tool calls and code run in a per-job pod, never in a trainer's process.

`tools` names what a call may run and gives the trainer its schemas; `server` (in the sandbox
pod) runs each call in a fresh child (`worker`, isolated by `jail`, started by `runner`);
`client` is what the trainer calls. The wire protocol is `rlhfjob.contract.sandbox`. Nothing is
imported here: the trainer's side reads `tools` without loading the server's.
"""
