// Stub for the g++ check (see ../cuda_stub.h).
#pragma once
