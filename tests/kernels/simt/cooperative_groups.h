// Stub for the SIMT emulation (simt.h).
#pragma once
